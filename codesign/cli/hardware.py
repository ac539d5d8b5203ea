"""`codesign hardware`: what the cost model believes of a config's devices and links, in the
units their public measurements use (nccl-tests' sizes and bus bandwidth, GEMM TFLOP/s), from the
very functions that price plans (hardware.device, hardware.gemm)."""

from __future__ import annotations

import argparse
import csv
import re
import sys
from typing import Iterable, TextIO

from codesign.cli.common import command_parser, config_arguments, setup_logging
from codesign.errors import UserError

EXAMPLES = [
    ("codesign hardware -c bench/plan_sim.toml", "each cluster's device, the source of its figures, HBM and links"),
    ("codesign hardware collectives -c bench/plan_sim.toml --sizes 1MiB,1GiB",
     "each collective on one host and on the whole cluster, as nccl-tests reports it"),
    ("codesign hardware gemm --device H100 --shapes 4096x4096x4096,8192x1024x8192", "GEMM seconds and TFLOP/s"),
]
COLLECTIVE_COLUMNS = ("cluster", "collective", "hosts", "devices", "bytes", "seconds", "busbw_gbps", "source")
GEMM_COLUMNS = ("device", "precision", "m", "n", "k", "seconds", "tflops", "source")
SUMMARY_COLUMNS = ("cluster", "device", "gemm_source", "collective_source", "hbm_gbps", "intra_link", "inter_link")
DEFAULT_SIZES = (*(2 ** (10 + 2 * i) for i in range(12)), 2 ** 33)  # 1 KiB to 4 GiB in powers of 4, and 8 GiB
UNITS = {"": 1, "k": 2 ** 10, "kib": 2 ** 10, "m": 2 ** 20, "mib": 2 ** 20, "g": 2 ** 30, "gib": 2 ** 30}


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("codesign hardware", "Show what the cost model believes of each cluster's devices "
                                                 "and links; run nothing.", EXAMPLES)
    config_arguments(parser, "Results DB whose measured profiles of other machines to use.")
    parser.add_argument("--format", choices=("table", "csv"), default="table")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    collectives = verbs.add_parser("collectives", help="all-reduce, all-gather, reduce-scatter, all-to-all by size")
    config_arguments(collectives, "Results DB whose measured profiles of other machines to use.")
    collectives.add_argument("--sizes", type=sizes, default=DEFAULT_SIZES,
                             help="Comma-separated bytes, with KiB/MiB/GiB suffixes (default: 1KiB to 8GiB in powers of 4).")
    collectives.add_argument("--format", choices=("table", "csv"), default="table")
    gemm = verbs.add_parser("gemm", help="GEMM seconds and TFLOP/s of a device kind by shape")
    gemm.add_argument("--device", required=True, help="A device kind: H100, H200, A100, or a measured one's name.")
    gemm.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    gemm.add_argument("--shapes", type=shapes, required=True, help="Comma-separated MxNxK.")
    gemm.add_argument("--format", choices=("table", "csv"), default="table")
    return parser


def sizes(text: str) -> tuple[int, ...]:
    found = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([kmg]i?b?|)\s*", part.lower().removesuffix("b") if part.lower().endswith(
            ("kb", "mb", "gb")) else part.lower())
        if not match or int(match.group(1)) < 1:
            raise argparse.ArgumentTypeError(f"expected sizes such as 1024,64KiB,1MiB,8GiB, got {part!r}")
        found.append(int(match.group(1)) * UNITS[match.group(2)])
    return tuple(found)


def shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    found = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", part.lower())
        if not match or min(int(g) for g in match.groups()) < 1:
            raise argparse.ArgumentTypeError(f"expected shapes such as 4096x4096x4096, got {part!r}")
        found.append(tuple(int(g) for g in match.groups()))
    return tuple(found)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose, "codesign: %(message)s")
    if args.verb == "gemm":
        rows = gemm_rows(args.device, args.precision, args.shapes)
        write(rows, GEMM_COLUMNS, args.format, sys.stdout)
        return 0
    from codesign.cli.session import session
    from codesign.config.loader import load_config

    config = load_config(args.config)
    with session(config, args.db, config.ray.address, learning=False) as here:
        book = here.profiles.book
    if args.verb == "collectives":
        write(collective_rows(config, book, args.sizes), COLLECTIVE_COLUMNS, args.format, sys.stdout)
    else:
        write(summary_rows(config, book), SUMMARY_COLUMNS, args.format, sys.stdout)
    return 0


def cluster_devices(config, book):
    """Each cluster of the config once, with the hardware's answers for it."""
    from codesign.hardware.device import Devices
    from codesign.hardware.links import cluster_links

    seen = {}
    for cluster in config.clusters:
        if cluster not in seen:
            profile = book.for_cluster(cluster, cluster.platform)
            seen[cluster] = Devices.of(profile, cluster, *cluster_links(profile, cluster, config.links))
    return seen.items()


def collective_rows(config, book, sizes_: Iterable[int]) -> Iterable[dict[str, object]]:
    from codesign.hardware.collectives import KINDS, bus_factor

    for cluster, hw in cluster_devices(config, book):
        groups = [(1, cluster.num_devices_per_host)] + ([(cluster.num_hosts, cluster.num_devices_per_host)]
                                                        if cluster.num_hosts > 1 else [])
        for kind in KINDS:
            for hosts, per_host in groups:
                n = hosts * per_host
                for nbytes in sizes_:
                    seconds = hw.collective(kind, nbytes, hosts, per_host)
                    busbw = bus_factor(kind, n) * nbytes / seconds / 1e9 if seconds else None
                    yield {"cluster": cluster.summary(), "collective": kind, "hosts": hosts, "devices": n,
                           "bytes": nbytes, "seconds": seconds, "busbw_gbps": busbw,
                           "source": hw.collective_source(hosts)}


def gemm_rows(device: str, precision: str, shapes_: Iterable[tuple[int, int, int]]) -> Iterable[dict[str, object]]:
    from codesign.hardware.gemm import gemm_seconds

    for m, n, k in shapes_:
        try:
            seconds, source = gemm_seconds(device, precision, m, n, k)
        except KeyError as err:
            raise UserError(f"--device {device!r}: {err.args[0]} (expected H100, H200 or A100)") from None
        yield {"device": device, "precision": precision, "m": m, "n": n, "k": k, "seconds": seconds,
               "tflops": 2 * m * n * k / seconds / 1e12, "source": source}


def summary_rows(config, book) -> Iterable[dict[str, object]]:
    for cluster, hw in cluster_devices(config, book):
        yield {"cluster": cluster.summary(), "device": hw.profile.kind, "gemm_source": hw.gemm_source(),
               "collective_source": hw.collective_source(cluster.num_hosts),
               "hbm_gbps": hw.profile.bandwidth / 1e9, "intra_link": str(hw.intra),
               "inter_link": str(hw.inter) if cluster.num_hosts > 1 else ""}


def write(rows: Iterable[dict[str, object]], columns: tuple[str, ...], fmt: str, out: TextIO) -> None:
    rows = list(rows)
    if fmt == "csv":
        writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
        return
    cells = [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    out.write("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip() + "\n")
    for r in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() + "\n")


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
