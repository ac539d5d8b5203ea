"""What every command's parser shares: the help formatter, the common flags, argument types,
logging, and the exit codes that scripts act on."""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap

from codesign.config.loader import DEFAULT_CONFIG

EXIT_USAGE = 2
EXIT_JOBS_FAILED = 3  # the sweep finished, but some jobs failed, timed out or went `oom`


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown only where there is one (not for flags without a value, nor for None);
    the description and the examples keep their line breaks, and long lines still wrap."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default is None:
            return action.help
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            inner = indent + line[:len(line) - len(line.lstrip())]
            lines.append(textwrap.fill(line.strip(), width, initial_indent=inner, subsequent_indent=inner)
                         if line.strip() else "")
        return "\n".join(lines)


def command_parser(prog: str, description: str, examples: list[tuple[str, str]]) -> argparse.ArgumentParser:
    """A command's parser with -v and an examples section: (command line, what it does) pairs."""
    epilog = "examples:\n" + "\n".join(f"  {line}\n      {about}" for line, about in examples)
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                     formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="Log progress (a sweep: each job's output).")
    return parser


def config_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, db_help: str) -> None:
    parser.add_argument("-c", "--config", default=str(DEFAULT_CONFIG), help="The path to the configuration.")
    parser.add_argument("-d", "--db", default="results.db", help=db_help)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def setup_logging(verbose: bool, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr, format=fmt)
