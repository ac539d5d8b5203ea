"""`codesign profile`: measure this machine's devices for the cost model, keep the profile in the
user's cache (shared by every DB and by `codesign plan`), and print it as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from codesign.cli.common import command_parser, positive_seconds, setup_logging
from codesign.cli.session import jax_cache_in
from codesign.errors import UserError

if TYPE_CHECKING:
    from codesign.run.profile_cache import Machine, ProfileCache

EXAMPLES = [
    ("codesign profile", "the GPUs where JAX sees some, else the CPU"),
    ("codesign profile && codesign reprice -d results.db", "then re-price a DB's attempts with it"),
    ("codesign profile --calibrations", "what the cost model has learned on this machine, one version a line"),
]


def build_parser() -> argparse.ArgumentParser:
    from codesign.run.profile_cache import PROFILE_TIMEOUT

    parser = command_parser("codesign profile", "Measure this machine's devices for the cost model, keep the "
                            "profile in the user's cache (shared by every DB and by `codesign plan`), and print "
                            "it as JSON.", EXAMPLES)
    parser.add_argument("--platform", choices=("cpu", "gpu"), help="Which devices to profile (default: the "
                                                                   "GPUs where JAX sees some, else the CPU).")
    parser.add_argument("--timeout", type=positive_seconds, default=PROFILE_TIMEOUT,
                        help="Seconds before giving up (CODESIGN_PROFILE_TIMEOUT sets the default).")
    parser.add_argument("--calibrations", action="store_true",
                        help="Measure nothing: list every calibration version the machine's runs have fitted.")
    return parser


def main(argv: list[str]) -> int:
    from codesign.run import discovery
    from codesign.run.profile_cache import ProfileCache, measure, this_machine

    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    hosts = discovery.local_hosts(args.platform != "cpu")
    platform = args.platform or ("gpu" if hosts.gpus[0] else "cpu")
    if platform == "gpu" and not hosts.gpus[0]:
        raise UserError("--platform gpu: JAX sees no GPU on this machine")
    cache = ProfileCache()
    if args.calibrations:
        return list_calibrations(this_machine(platform, hosts), cache)
    profile = measure(this_machine(platform, hosts), cache, jax_cache_in(cache.root), timeout=args.timeout)
    if profile is None:
        return 1
    print(f"codesign: kept in {cache.path(this_machine(platform, hosts))}; `codesign reprice -d DB` re-prices "
          "a DB's attempts with it", file=sys.stderr)
    json.dump(profile.to_dict(), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


def list_calibrations(machine: Machine, cache: ProfileCache) -> int:
    """Each calibration version of the machine, oldest first, on stdout."""
    from codesign.run.learning import calibration_versions

    versions = calibration_versions(cache, machine)
    if not versions:
        print(f"codesign: no calibration of the {machine} yet: it is fitted once "
              "its runs have measured a few attempts", file=sys.stderr)
    for version in versions:
        print(version.summary())
    return 0
