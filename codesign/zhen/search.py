"""`--search-model`: enumerate ZHEN architectures, filter and sample them, print `[[model]]` TOML.

The space holds every model of up to `max_layers` layers with exactly `slots` mixers in all
(at least one per layer), a layer being a multiset over the allowed kinds. It is never
materialised: it is cut into blocks, one per (kinds, composition n_1..n_L). Inside a block,
layer i's multisets are the rows of a count matrix and a candidate is a mixed-radix index over
those rows (last layer fastest). A layer's parameters depend only on its multiset, n_{i-1} and
n_{i-2}, so a block's parameter totals are sums of per-layer vectors, computed in fixed-size
chunks: time grows with the space, memory does not.

Selection: the base spec, then one group after another (similar parameter count, then one
group per depth), each up to its limit, drawn uniformly from the candidates that pass it and
were not chosen before. A first pass counts the passers of each group; the draws pick ranks
among them; a second pass decodes only the chosen ranks.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from dataclasses import dataclass
from math import comb, prod
from typing import Iterator, TextIO

import numpy as np
from tqdm import tqdm

from codesign.errors import ConfigError
from codesign.config.types import MIXERS, ModelSpec
from codesign.zhen import counts

DEFAULT_KINDS = "DOT,LINEAR,ATTENTION"
DEFAULT_BASE_TOKENS = "ATTENTION,LINEAR,ATTENTION,DOT"
DEFAULT_BASE_LAYERS = 4
DEFAULT_DEPTHS = "1,2,3"
ANY_KIND = "ANY"
CHUNK = 1 << 14  # candidates priced at once: 128 KiB arrays stay in cache and bound memory


@dataclass(frozen=True)
class Group:
    """One part of the selection: up to `limit` candidates drawn from those that pass."""

    name: str
    limit: int
    layers: int | None = None  # exactly this many layers
    tolerance: float | None = None  # |params - base| / max(params, base) < tolerance

    def describe(self, base_params: int) -> str:
        if self.tolerance is None:
            return self.name
        return f"{self.name} (parameters within {self.tolerance * 100:g}% of {base_params:,})"


@dataclass(frozen=True)
class Search:
    """A validated `--search-model` request: the space, its space-wide filters, the groups."""

    base: ModelSpec
    max_layers: int
    slots: int
    kinds: tuple[str, ...]
    num_layers: int | None  # restricts the whole space
    uniform_kind: str | None  # a kind or ANY_KIND: restricts the whole space to one-kind models
    groups: tuple[Group, ...]
    seed: int


@dataclass(frozen=True)
class Block:
    """The candidates sharing one kinds set and one composition (mixers per layer)."""

    kinds: tuple[str, ...]
    layers: tuple[int, ...]

    @property
    def size(self) -> int:
        return prod(multisets(n, len(self.kinds)).shape[0] for n in self.layers)


# The size of the space.

def space_size(max_layers: int, slots: int, num_kinds: int) -> int:
    """Closed form of sum_L [x^N] ((1-x)^-K - 1)^L, the number of candidates.

    A layer of n mixers has C(n+K-1, K-1) multisets, so one layer's generating function is
    (1-x)^-K - 1; expanding its L-th power by the binomial theorem gives
    sum_j (-1)^(L-j) C(L, j) C(N + jK - 1, N) (the j = 0 term vanishes for N >= 1).
    """
    return sum((-1) ** (layers - j) * comb(layers, j) * comb(slots + j * num_kinds - 1, slots)
               for layers in range(1, max_layers + 1) for j in range(1, layers + 1))


def compositions(slots: int, layers: int) -> Iterator[tuple[int, ...]]:
    """Every way to split `slots` into `layers` positive parts, in lexicographic order of cuts."""
    for cuts in itertools.combinations(range(1, slots), layers - 1):
        bounds = (0, *cuts, slots)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


@functools.lru_cache(maxsize=None)
def multisets(n: int, num_kinds: int) -> np.ndarray:
    """Count vectors (rows) of every multiset of n mixers over num_kinds kinds."""
    rows = [np.bincount(c, minlength=num_kinds)
            for c in itertools.combinations_with_replacement(range(num_kinds), n)]
    return np.array(rows, dtype=np.int64)


def space_blocks(search: Search) -> list[Block]:
    """The blocks of the space after the space-wide filters (--num-layers, --uniform-kind)."""
    if search.uniform_kind is None:
        kind_sets = [search.kinds]
    elif search.uniform_kind == ANY_KIND:
        kind_sets = [(k,) for k in search.kinds]
    else:
        kind_sets = [(search.uniform_kind,)]
    depths = [search.num_layers] if search.num_layers else range(1, search.max_layers + 1)
    return [Block(kinds, comp) for kinds in kind_sets for layers in depths
            for comp in compositions(search.slots, layers)]


# Parameter counts, vectorised over a block (the same formulas as counts.layer_param_count).

@functools.lru_cache(maxsize=None)
def _mixer_totals(kinds: tuple[str, ...], n: int, f_in: int, out: int, emb: int) -> np.ndarray:
    """Mixer parameters of every multiset of n mixers reading f_in features."""
    weights = np.array([counts.mixer_params(k, f_in, out, emb) for k in kinds], dtype=np.int64)
    return multisets(n, len(kinds)) @ weights


def block_layer_params(block: Block, base: ModelSpec) -> tuple[int, list[np.ndarray]]:
    """(params shared by the whole block, per-layer vectors of the mixers' params)."""
    feats, out, emb = base.num_features, base.output_per_emb, base.emb_dim
    shared, vectors = 0, []
    for i, n in enumerate(block.layers):
        f_in, skip = counts.feature_widths(feats, out, block.layers, i)
        shared += counts.layer_shared_params(i, f_in, skip, emb)
        vectors.append(_mixer_totals(block.kinds, n, f_in, out, emb))
    return shared, vectors


def digits(index: np.ndarray, radices: list[int]) -> Iterator[tuple[int, np.ndarray]]:
    """(layer, digit) of flat indices in mixed radix, from the last layer (the fastest) back.

    A generator, so that a caller summing over layers holds one digit array at a time.
    """
    for layer in reversed(range(len(radices))):
        index, digit = np.divmod(index, radices[layer])
        yield layer, digit


def block_params(block: Block, base: ModelSpec, start: int, stop: int) -> np.ndarray:
    """Parameter counts of the block's candidates start..stop-1."""
    shared, vectors = block_layer_params(block, base)
    total = np.full(stop - start, shared, dtype=np.int64)
    for layer, digit in digits(np.arange(start, stop, dtype=np.int64), [len(v) for v in vectors]):
        total += vectors[layer][digit]
    return total


def decode(block: Block, index: int, base: ModelSpec) -> ModelSpec:
    """The model of one flat index in a block; mixers in the order of the kinds."""
    rows = [multisets(n, len(block.kinds)) for n in block.layers]
    found = dict(digits(np.array(index, dtype=np.int64), [len(r) for r in rows]))
    tokens = tuple(layer_tokens(block.kinds, rows[i][found[i]]) for i in range(len(rows)))
    return ModelSpec(base.num_features, base.emb_dim, base.output_per_emb, len(tokens), tokens)


def layer_tokens(kinds: tuple[str, ...], multiplicities: np.ndarray) -> tuple[str, ...]:
    return tuple(kind for kind, count in zip(kinds, multiplicities.tolist()) for _ in range(count))


def spec_key(spec: ModelSpec) -> tuple:
    """Identity of a model up to the order of mixers inside a layer (they are a multiset)."""
    return (spec.num_features, spec.emb_dim, spec.output_per_emb,
            tuple(tuple(sorted(layer)) for layer in spec.tokens))


# Filtering and sampling.

def _masks(block: Block, group: Group, base: ModelSpec, base_params: int
           ) -> Iterator[tuple[int, np.ndarray]]:
    """(chunk start, pass mask) over a block whose depth passes the group: flat memory."""
    for start in range(0, block.size, CHUNK):
        params = block_params(block, base, start, min(block.size, start + CHUNK))
        yield start, np.abs(params - base_params) < group.tolerance * np.maximum(params, base_params)


def _depth_passes(block: Block, group: Group) -> bool:
    return group.layers is None or group.layers == len(block.layers)


def similar(search: Search) -> Iterator[tuple[Block, np.ndarray, np.ndarray]]:
    """(block, flat indices, parameter counts) of every candidate within --param-tolerance of the
    base, after the space-wide filters, block by block in space order: `codesign search --rank`
    takes them all (no draw)."""
    base_params, group = counts.param_count(search.base), search.groups[0]
    for block in space_blocks(search):
        for start, mask in _masks(block, group, search.base, base_params):
            hits = np.flatnonzero(mask)
            if hits.size:
                index = hits + start
                yield block, index, block_params(block, search.base, start, start + len(mask))[hits]


def count_passing(block: Block, group: Group, base: ModelSpec, base_params: int) -> int:
    if not _depth_passes(block, group):
        return 0
    if group.tolerance is None:
        return block.size
    return sum(int(np.count_nonzero(mask)) for _, mask in _masks(block, group, base, base_params))


def passing_positions(block: Block, group: Group, ranks: np.ndarray, base: ModelSpec,
                      base_params: int) -> np.ndarray:
    """Flat indices in the block of its passers numbered `ranks` (0-based, sorted)."""
    if group.tolerance is None:
        return ranks
    found, seen = [], 0
    for start, mask in _masks(block, group, base, base_params):
        hits = np.flatnonzero(mask)
        wanted = ranks[(ranks >= seen) & (ranks < seen + len(hits))]
        found.append(hits[wanted - seen] + start)
        seen += len(hits)
    return np.concatenate(found)


@dataclass(frozen=True)
class Choice:
    group: str
    spec: ModelSpec
    params: int


def select(search: Search) -> list[Choice]:
    """The base spec, then each group's draws; deterministic for a seed, no model twice."""
    base_params = counts.param_count(search.base)
    blocks = space_blocks(search)
    _report(f"search space: {space_size(search.max_layers, search.slots, len(search.kinds)):,} "
            f"candidates (up to {search.max_layers} layers, {search.slots} slots, "
            f"kinds {', '.join(search.kinds)})")
    if search.num_layers or search.uniform_kind:
        _report(f"after --num-layers/--uniform-kind: {sum(b.size for b in blocks):,} candidates")
    passing = _count_all(blocks, search, base_params)
    rng = np.random.default_rng(search.seed)
    chosen = [Choice("base", search.base, base_params)]
    taken = {spec_key(search.base)}
    for g, group in enumerate(search.groups):
        total = int(passing[:, g].sum())
        # Up to len(taken) of the draws may repeat earlier choices; drawing that many more
        # keeps the group uniform over the passers not yet chosen.
        ranks = rng.choice(total, size=min(total, group.limit + len(taken)), replace=False).tolist()
        picked = _decode_ranks(blocks, passing[:, g], ranks, group, search.base, base_params)
        fresh = [r for r in ranks if spec_key(picked[r].spec) not in taken][:group.limit]
        chosen += [picked[r] for r in sorted(fresh)]  # drawn in random order, printed in space order
        taken.update(spec_key(picked[r].spec) for r in fresh)
        _report(f"{group.describe(base_params)}: {total:,} pass, {len(fresh)} chosen")
        if group.limit and not fresh:
            _report(f"{group.name}: empty, no candidate left that passes the filters")
    return chosen


def _count_all(blocks: list[Block], search: Search, base_params: int) -> np.ndarray:
    """Passers per block (rows) and group (columns): the pass over the whole space."""
    passing = np.zeros((len(blocks), len(search.groups)), dtype=np.int64)
    with tqdm(total=sum(b.size for b in blocks), desc="model search", unit="cand", unit_scale=True,
              file=sys.stderr, disable=None, leave=False) as bar:
        for i, block in enumerate(blocks):
            passing[i] = [count_passing(block, g, search.base, base_params) for g in search.groups]
            bar.update(block.size)
    return passing


def _decode_ranks(blocks: list[Block], passing: np.ndarray, ranks: list[int], group: Group,
                  base: ModelSpec, base_params: int) -> dict[int, Choice]:
    """The candidates of the group's passers numbered `ranks` (counted in space order)."""
    ranks, ends = np.asarray(ranks, dtype=np.int64), np.cumsum(passing)
    where = np.searchsorted(ends, ranks, side="right")
    picked = {}
    for b in np.unique(where):
        block, first = blocks[b], ends[b] - passing[b]
        within = np.sort(ranks[where == b] - first)
        for rank, index in zip(within, passing_positions(block, group, within, base, base_params)):
            params = int(block_params(block, base, int(index), int(index) + 1)[0])
            picked[int(rank + first)] = Choice(group.name, decode(block, int(index), base), params)
    return picked


# TOML out: compact inline arrays as users write them (tomli-w spreads each over many lines).

def _toml_value(value: int | str | list) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # ints, and mixer names (plain ASCII), read the same in TOML


def to_toml(choice: Choice, base_params: int) -> str:
    change = (choice.params - base_params) / base_params
    versus = "" if choice.group == "base" else f" ({change:+.1%} vs base)"
    lines = [f"# {choice.group}: {choice.params:,} parameters{versus}", "[[model]]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in choice.spec.to_toml().items()]
    return "\n".join(lines) + "\n"


def _report(message: str) -> None:
    """User-facing search figures on stderr (stdout is the TOML), beside the progress bar."""
    tqdm.write(f"codesign: {message}", file=sys.stderr)


# Command line.

def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "model search", "With --search-model: the space, the base spec, the filters and the limits. "
        "--num-layers, --uniform-kind and --param-tolerance restrict every group; the output is the "
        "base spec, then --max-similar models of similar parameter count, then --max-per-depth "
        "models per depth in --depths, none repeated; an empty group is reported on stderr.")
    g.add_argument("--max-layers", type=int, default=DEFAULT_BASE_LAYERS, help="Most layers of a candidate.")
    g.add_argument("--slots", type=int, default=12, help="Token mixers per candidate, over all its layers.")
    g.add_argument("--kinds", default=DEFAULT_KINDS,
                   help=f"Comma-separated mixer kinds from {', '.join(MIXERS)}.")
    g.add_argument("--base-features", type=int, default=512,
                   help="F of the base spec and of every candidate.")
    g.add_argument("--base-emb-dim", type=int, default=160, help="D of the base spec and of every candidate.")
    g.add_argument("--base-output-per-emb", type=int, default=50,
                   help="O of the base spec and of every candidate.")
    g.add_argument("--base-tokens", default=DEFAULT_BASE_TOKENS,
                   help="Base spec mixers, comma-separated; '/' separates per-layer lists.")
    g.add_argument("--base-layers", type=int, default=None,
                   help=f"Base spec layers; unset: {DEFAULT_BASE_LAYERS} for one --base-tokens list, "
                   "else the number of per-layer lists.")
    g.add_argument("--param-tolerance", type=float, default=0.1,
                   help="Similar means |params - base| / max(params, base) below this.")
    g.add_argument("--num-layers", type=int, default=None,
                   help="Only candidates of exactly this many layers.")
    g.add_argument("--uniform-kind", default=None,
                   help="Only candidates whose mixers are all of this kind ('any': all of one kind).")
    g.add_argument("--max-similar", type=int, default=100, help="Most candidates of similar parameter count.")
    g.add_argument("--max-per-depth", type=int, default=20, help="Most candidates per depth in --depths.")
    g.add_argument("--depths", default=DEFAULT_DEPTHS, help="Comma-separated layer counts, one group each.")
    g.add_argument("--seed", type=int, default=0,
                   help="Seed of the draws: the same seed gives the same output.")


def search_from_args(args: argparse.Namespace) -> Search:
    """Validate the flags into a Search; every error names the flag."""
    max_layers = _at_least(args.max_layers, 1, "--max-layers")
    slots = _at_least(args.slots, 1, "--slots")
    kinds = _kinds(args.kinds, "--kinds")
    if len(set(kinds)) != len(kinds):
        _fail("--kinds", f"repeats a kind: {args.kinds!r}")
    num_layers = None if args.num_layers is None else _at_least(args.num_layers, 1, "--num-layers")
    if num_layers and num_layers > min(max_layers, slots):
        _fail("--num-layers", f"{num_layers} exceeds --max-layers {max_layers} or --slots {slots}")
    uniform = None if args.uniform_kind is None else args.uniform_kind.upper()
    if uniform not in (None, ANY_KIND, *kinds):
        _fail("--uniform-kind", f"expected 'any' or one of --kinds {list(kinds)}, got {args.uniform_kind!r}")
    if not args.param_tolerance > 0:
        _fail("--param-tolerance", f"expected a positive number, got {args.param_tolerance!r}")
    depths = _positive_ints(args.depths, "--depths")
    per_depth = _at_least(args.max_per_depth, 0, "--max-per-depth")
    groups = (Group("similar", _at_least(args.max_similar, 0, "--max-similar"),
                    tolerance=args.param_tolerance),
              *(Group(f"{d} layer{'s' if d > 1 else ''}", per_depth, layers=d,
                      tolerance=args.param_tolerance) for d in depths))
    return Search(base=_base_spec(args), max_layers=max_layers, slots=slots, kinds=kinds,
                  num_layers=num_layers, uniform_kind=uniform, groups=groups,
                  seed=_at_least(args.seed, 0, "--seed"))


def _base_spec(args: argparse.Namespace) -> ModelSpec:
    per_layer = tuple(_kinds(layer, "--base-tokens") for layer in args.base_tokens.split("/"))
    if len(per_layer) == 1:
        layers = _at_least(args.base_layers or DEFAULT_BASE_LAYERS, 1, "--base-layers")
        per_layer = per_layer * layers
    elif args.base_layers not in (None, len(per_layer)):
        _fail("--base-layers", f"{args.base_layers} but --base-tokens has {len(per_layer)} per-layer lists")
    return ModelSpec(_at_least(args.base_features, 1, "--base-features"),
                     _at_least(args.base_emb_dim, 1, "--base-emb-dim"),
                     _at_least(args.base_output_per_emb, 1, "--base-output-per-emb"),
                     len(per_layer), per_layer)


def _kinds(text: str, flag: str) -> tuple[str, ...]:
    kinds = tuple(k.strip().upper() for k in text.split(","))
    bad = [k for k in kinds if k not in MIXERS]
    if bad:
        _fail(flag, f"unknown mixer {bad[0]!r}; expected comma-separated names from {list(MIXERS)}")
    return kinds


def _positive_ints(text: str, flag: str) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        _fail(flag, f"expected comma-separated integers >= 1, got {text!r}")
    return [int(p) for p in parts]


def _at_least(value: int, minimum: int, flag: str) -> int:
    if value < minimum:
        _fail(flag, f"expected an integer >= {minimum}, got {value}")
    return value


def _fail(flag: str, problem: str):
    raise ConfigError(path="command line", table="--search-model", field=flag, problem=problem)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Print the selection as TOML on `out`; the space size and progress go to stderr."""
    choices = select(search_from_args(args))
    base_params = choices[0].params
    out.write("\n".join(to_toml(c, base_params) for c in choices))
    return 0
