"""Speed and memory of `--search-model`: enumerate, price, filter and draw the default selection.

Goals (issue): the 3-kind space (998,738 candidates) in under 5 s on 2 cores, the 4-kind space
(13,528,268) in under 60 s, memory flat as the space grows. Prints figures; asserts nothing.

    python bench/bench_search.py            # the two spaces of the issue, then 3 kinds by slots
    python bench/bench_search.py --max-slots 20
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time
import tracemalloc

from codesign.zhen import search

DEFAULT = search.search_from_args(argparse.Namespace(
    max_layers=4, slots=12, kinds=search.DEFAULT_KINDS, base_features=512, base_emb_dim=160,
    base_output_per_emb=50, base_tokens=search.DEFAULT_BASE_TOKENS, base_layers=None,
    param_tolerance=0.1, num_layers=None, uniform_kind=None, max_similar=100, max_per_depth=20,
    depths=search.DEFAULT_DEPTHS, seed=0))


def measure(space: search.Search) -> tuple[float, float]:
    """(seconds of one default selection, peak MiB traced during a second one)."""
    start = time.perf_counter()
    search.select(space)
    seconds = time.perf_counter() - start
    tracemalloc.start()
    search.select(space)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-slots", type=int, default=16, help="Largest slot count of the 3-kind series.")
    args = parser.parse_args()
    cases = [("3 kinds (issue)", DEFAULT),
             ("4 kinds (issue)", dataclasses.replace(DEFAULT, kinds=search.MIXERS))]
    cases += [(f"3 kinds, {n} slots", dataclasses.replace(DEFAULT, slots=n))
              for n in range(8, args.max_slots + 1, 4) if n != 12]
    print(f"{'space':<22}{'candidates':>16}{'seconds':>10}{'cand/s':>14}{'peak MiB':>10}")
    for name, space in cases:
        size = search.space_size(space.max_layers, space.slots, len(space.kinds))
        seconds, peak = measure(space)
        print(f"{name:<22}{size:>16,}{seconds:>10.2f}{size / seconds:>14,.0f}{peak:>10.1f}", flush=True)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"process max RSS (numpy's import included): {maxrss:.0f} MiB")


if __name__ == "__main__":
    main()
