"""What every command's parser shares: the common flags, argument types, logging, and the exit
codes that scripts act on."""

from __future__ import annotations

import argparse
import logging
import sys

from codesign.config.loader import DEFAULT_CONFIG

EXIT_USAGE = 2
EXIT_JOBS_FAILED = 3  # the sweep finished, but some jobs failed, timed out or went `oom`


def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A command's parser, with -v."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
