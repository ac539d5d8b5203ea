"""Model search: the size of the space, the parameter counts, the filters, the draws, the TOML."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import io
import itertools
import subprocess
import sys
import tomllib

import numpy as np
import pytest

from codesign.errors import ConfigError
from codesign.config.loader import load_config
from codesign.config.types import MIXERS, ModelSpec
from codesign.zhen import counts, search
from tests.reference import built_param_count

CONFIG_HEAD = """
[training_spec]
avg_batch_size_per_device = 8
num_iters = 2

[[cluster_spec]]
num_hosts = 1
num_devices_per_host = 1
transport = "NVLink"

[[parallel_spec]]
description = "Auto search"
num_micro_batches = [1]

"""


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    search.add_arguments(parser)
    return parser.parse_args(list(flags))


def select(*flags: str) -> list[search.Choice]:
    return search.select(search.search_from_args(parse(*flags)))


def toml_of(*flags: str) -> str:
    out = io.StringIO()
    assert search.run(parse(*flags), out) == 0
    return out.getvalue()


def brute_force_space(max_layers: int, slots: int, kinds: tuple[str, ...]) -> set[tuple]:
    """Every candidate, spelled out layer by layer without the module's enumeration."""
    found = set()
    for layers in range(1, max_layers + 1):
        for sizes in itertools.product(range(1, slots + 1), repeat=layers):
            if sum(sizes) != slots:
                continue
            per_layer = [list(itertools.combinations_with_replacement(kinds, n)) for n in sizes]
            found.update(tuple(tuple(sorted(layer)) for layer in model)
                         for model in itertools.product(*per_layer))
    return found


def test_space_size_of_the_issue():
    assert search.space_size(4, 12, 3) == 998_738
    assert search.space_size(4, 12, 4) == 13_528_268


@pytest.mark.parametrize("max_layers,slots,num_kinds",
                         [(1, 1, 1), (1, 5, 3), (2, 4, 2), (3, 6, 3), (4, 5, 4), (5, 3, 2)])
def test_closed_form_and_blocks_equal_brute_force(max_layers, slots, num_kinds):
    kinds = MIXERS[:num_kinds]
    brute = brute_force_space(max_layers, slots, kinds)
    space = search.Search(base=_base(), max_layers=max_layers, slots=slots, kinds=kinds,
                          num_layers=None, uniform_kind=None, groups=(), seed=0)
    decoded = [search.spec_key(search.decode(block, i, space.base))[3]
               for block in search.space_blocks(space) for i in range(block.size)]
    assert search.space_size(max_layers, slots, num_kinds) == len(brute)
    assert len(decoded) == len(set(decoded)) and set(decoded) == brute


def _base(features: int = 512, emb: int = 160, out: int = 50) -> ModelSpec:
    return ModelSpec(features, emb, out, 4, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 4)


def test_vectorised_params_equal_the_formula_on_a_whole_space():
    base = _base(features=24, emb=8, out=6)  # 4 * 6 == 24: some layers skip the projection
    space = search.Search(base=base, max_layers=4, slots=6, kinds=MIXERS, num_layers=None,
                          uniform_kind=None, groups=(), seed=0)
    for block in search.space_blocks(space):
        vectorised = search.block_params(block, base, 0, block.size)
        formula = [counts.param_count(search.decode(block, i, base)) for i in range(block.size)]
        assert vectorised.tolist() == formula


def test_params_equal_the_built_model_on_random_candidates():
    base = _base()
    space = search.Search(base=base, max_layers=4, slots=12, kinds=MIXERS, num_layers=None,
                          uniform_kind=None, groups=(), seed=0)
    blocks = search.space_blocks(space)
    rng = np.random.default_rng(7)
    for b in rng.choice(len(blocks), size=5, replace=False):
        block = blocks[b]
        index = int(rng.integers(block.size))
        spec = search.decode(block, index, base)
        assert int(search.block_params(block, base, index, index + 1)[0]) == built_param_count(spec)


def test_cli_prints_only_toml_that_loads_back_as_the_selection(tmp_path):
    result = subprocess.run([sys.executable, "-m", "codesign", "--search-model", "--seed", "3"],
                            capture_output=True, text=True, check=True)
    assert set(tomllib.loads(result.stdout)) == {"model"}
    assert "998,738" in result.stderr
    path = tmp_path / "config.toml"
    path.write_text(CONFIG_HEAD + result.stdout)
    assert [m for m in load_config(path).models] == [c.spec for c in select("--seed", "3")]
    # homogeneous specs (the base) are written as a flat list
    assert tomllib.loads(result.stdout)["model"][0]["tokens"] == ["ATTENTION", "LINEAR", "ATTENTION", "DOT"]


def test_default_selection_holds_its_groups_and_no_repeats(capsys):
    choices = select()
    groups = collections.Counter(c.group for c in choices)
    assert choices[0].group == "base" and choices[0].spec == _base()
    # no 1-layer model of 12 mixers comes within 10% of the base's parameters: that group is empty
    assert groups == {"base": 1, "similar": 100, "2 layers": 20, "3 layers": 20}
    err = capsys.readouterr().err
    assert "1 layer (parameters within 10% of 218,433,200): 0 pass, 0 chosen" in err
    assert "codesign: 1 layer: empty, no candidate left that passes the filters" in err
    assert "2 layers (parameters within 10% of 218,433,200): 307 pass, 20 chosen" in err
    assert len({search.spec_key(c.spec) for c in choices}) == len(choices)
    base_params = counts.param_count(_base())
    for c in choices[1:]:
        assert c.params == counts.param_count(c.spec)
        assert sum(map(len, c.spec.tokens)) == 12 and 1 <= c.spec.num_zhen_layers <= 4
        assert {m for layer in c.spec.tokens for m in layer} <= {"DOT", "LINEAR", "ATTENTION"}
        assert abs(c.params - base_params) / max(c.params, base_params) < 0.1  # every group
        if c.group != "similar":
            assert c.spec.num_zhen_layers == int(c.group[0])


def test_same_seed_same_output_other_seed_other_output():
    assert toml_of("--seed", "5") == toml_of("--seed", "5")
    assert toml_of("--seed", "5") != toml_of("--seed", "6")


def test_chunking_does_not_change_the_selection(monkeypatch):
    flags = ("--kinds", "DOT,CONVOLUTION,LINEAR", "--max-layers", "3", "--slots", "8")
    whole = select(*flags)
    monkeypatch.setattr(search, "CHUNK", 7)
    assert select(*flags) == whole


@pytest.mark.parametrize("flags,check", [
    (("--num-layers", "2", "--param-tolerance", "0.05"),
     lambda c, base: c.spec.num_zhen_layers == 2 and abs(c.params - base) / max(c.params, base) < 0.05),
    (("--uniform-kind", "any"),
     lambda c, base: len({m for layer in c.spec.tokens for m in layer}) == 1),
    (("--uniform-kind", "attention", "--num-layers", "3", "--param-tolerance", "0.99"),
     lambda c, base: c.spec.num_zhen_layers == 3 and abs(c.params - base) / max(c.params, base) < 0.99
     and {m for layer in c.spec.tokens for m in layer} == {"ATTENTION"}),
])
def test_filters_hold_on_every_emitted_spec(flags, check):
    choices = select(*flags)
    base = choices[0].params
    assert len(choices) > 10 and all(check(c, base) for c in choices[1:])


def test_small_space_is_emitted_whole_without_repeating_the_base():
    flags = ("--base-tokens", "DOT/LINEAR", "--max-layers", "2", "--slots", "2", "--kinds", "DOT,LINEAR",
             "--param-tolerance", "1", "--max-per-depth", "0")
    choices = select(*flags)
    keys = [search.spec_key(c.spec)[3] for c in choices]
    assert sorted(keys) == sorted(brute_force_space(2, 2, ("DOT", "LINEAR")))


def test_draws_are_uniform_over_the_passers():
    flags = ("--max-layers", "2", "--slots", "3", "--kinds", "DOT,LINEAR", "--max-similar", "0",
             "--max-per-depth", "1", "--depths", "2", "--param-tolerance", "1")  # 1: every model passes
    space = search.search_from_args(parse(*flags))
    seen = collections.Counter(search.spec_key(search.select(dataclasses.replace(space, seed=seed))[1].spec)
                               for seed in range(1200))
    assert len(seen) == 12  # (1,2) and (2,1): 2 * 3 + 3 * 2 candidates
    assert all(50 <= n <= 150 for n in seen.values())


@pytest.mark.parametrize("flags,field", [
    (("--slots", "0"), "--slots"), (("--kinds", "DOT,FOO"), "--kinds"), (("--kinds", "DOT,DOT"), "--kinds"),
    (("--num-layers", "5"), "--num-layers"), (("--uniform-kind", "CONVOLUTION"), "--uniform-kind"),
    (("--param-tolerance", "0"), "--param-tolerance"), (("--depths", "1,x"), "--depths"),
    (("--max-similar", "-1"), "--max-similar"), (("--base-tokens", "DOT/LINEAR", "--base-layers", "3"),
                                                  "--base-layers"), (("--seed", "-1"), "--seed"),
])
def test_bad_flags_name_the_flag(flags, field):
    with pytest.raises(ConfigError) as err:
        search.search_from_args(parse(*flags))
    assert err.value.field == field and err.value.path == "command line"


def test_cli_exits_2_on_a_bad_flag():
    result = subprocess.run([sys.executable, "-m", "codesign", "--search-model", "--slots", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == "" and "--slots" in result.stderr
