"""`codesign` (and `python -m codesign`): one program, verbs as subcommands, one module each
(sharing session.py's setup); maps errors to exit codes (common.py's, and 128 + signal).

The earlier toolkit's command lines keep working: without a subcommand the arguments are run's
(`python -m codesign -c X`), and `--search-model` is `codesign search`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable

from codesign import __version__
from codesign.cli import export, hardware, plan, profile, report, reprice, run, search
from codesign.cli.common import EXIT_USAGE
from codesign.cli.run import build_parser as build_run_parser
from codesign.cli.search import build_parser as build_search_parser
from codesign.errors import UserError

__all__ = ["build_run_parser", "build_search_parser", "dispatch", "main"]  # the parsers: for tests and benches

GLOBAL_FLAGS = ("-v", "--verbose")

# `codesign NAME ARGS`: NAME -> (what runs it, its line in `codesign --help`)
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "run": (run.main, "run every job of a config not yet recorded (the default command)"),
    "plan": (plan.main, "rank every plan by predicted time; run nothing"),
    "profile": (profile.main, "measure this machine's devices for the cost model"),
    "hardware": (hardware.main, "show what the cost model believes of GEMMs and collectives"),
    "reprice": (reprice.main, "re-price a DB's recorded attempts with the profiles at hand"),
    "report": (report.main, "write the report of a results DB"),
    "export": (export.main, "write a results DB's attempts as CSV"),
    "search": (search.main, "print candidate model specs as TOML"),
}


def build_parser() -> argparse.ArgumentParser:
    """`codesign --help`: the program and its commands."""
    parser = argparse.ArgumentParser(
        prog="codesign", description="Co-design a ZHEN model with its distributed training plan. Without a "
        "command, the arguments are `run`'s; --search-model is `search`.",
        epilog="`codesign COMMAND --help` shows a command's flags and examples.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="Log progress.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, (_, about) in COMMANDS.items():
        commands.add_parser(name, help=about, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background (run.sh)
    try:
        return dispatch(argv)
    except UserError as err:
        print(f"codesign: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("codesign: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # stdout piped into `head` and closed: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def dispatch(argv: list[str]) -> int:
    """`codesign [-v] COMMAND ARGS`, or the earlier toolkit's flags alone (run's, or search's)."""
    leading = 0
    while leading < len(argv) and argv[leading] in GLOBAL_FLAGS:
        leading += 1
    rest = argv[leading:]
    if rest and rest[0] in COMMANDS:
        return COMMANDS[rest[0]][0](argv[:leading] + rest[1:])
    if rest and rest[0] in ("-h", "--help", "--version"):
        build_parser().parse_args(rest)
    if "--search-model" in argv:
        return search.main(argv, prog="codesign")
    return run.main(argv, prog="codesign")
