"""`codesign search --rank`: the fast pass is Auto search's answer, pruning changes no winner, the
TOML loads, a candidate that fits nothing says why, the CSV's samples/J and energy frontier are
its plans' estimates, the report's Co-design section is the CSV's."""

import contextlib
import dataclasses
import hashlib
import io
import re

import numpy as np
import pandas as pd
import pytest
from scipy.stats import spearmanr

from codesign.cli import build_search_parser, main
from codesign.planner import fast_pass
from codesign.planner import objective
from codesign.planner import ranking
from codesign.planner.auto import all_plans, choose_plan
from codesign.cost.model import Workload, estimate
from codesign.cost.plan import plan_from_stages, plan_name
from codesign.hardware.profiles import BUILTIN, ProfileBook
from codesign.config.loader import load_config
from codesign.config.types import AUTO_SEARCH, ClusterSpec, ParallelSpec, TrainingSpec
from codesign.store.database import Store
from codesign.zhen import search
from tests.test_report import Page

SMALL = ["--base-features", "32", "--base-emb-dim", "16", "--base-output-per-emb", "4", "--slots", "3",
         "--max-layers", "3", "--param-tolerance", "1"]
CONFIG = """
[training_spec]
avg_batch_size_per_device = {batch}
num_iters = 5

[[model]]
num_features = 32
emb_dim = 16
output_per_emb = 4
num_zhen_layers = 1
tokens = ["DOT"]

[[cluster_spec]]
num_hosts = 1
num_devices_per_host = 4
transport = "NVLink"
platform = "sim"
device = "{device}"

[[parallel_spec]]
description = "Auto search"
num_micro_batches = [2]
num_auto_layers = {groups}
"""


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def config_file(tmp_path, batch: int = 16, device: str = "H100", groups: int = 1):
    path = tmp_path / "config.toml"
    path.write_text(CONFIG.format(batch=batch, device=device, groups=groups))
    return path


def query(*flags: str) -> search.Search:
    return search.search_from_args(build_search_parser().parse_args([*SMALL, *flags]))


@pytest.mark.parametrize("cluster, cores", [
    (ClusterSpec(1, 8, "NVLink", "sim", "H100"), 0), (ClusterSpec(2, 4, "EFAx4", "sim", "A100"), 0),
    (ClusterSpec(1, 4, "NVLink", "sim", "cpu"), 0), (ClusterSpec(1, 8, "NVLink", "sim", "cpu"), 2)])
@pytest.mark.parametrize("micro", [1, 2])
def test_the_fast_pass_is_auto_searchs_answer_for_one_layer_group(cluster, cores, micro):
    book = ProfileBook()
    book.add(dataclasses.replace(BUILTIN["cpu"], shared=dataclasses.replace(BUILTIN["cpu"].shared, cores=cores)))  # cores: op groups' fixed costs overlap
    fast_pass_is_auto_search(cluster, micro, book)


def fast_pass_is_auto_search(cluster: ClusterSpec, micro: int, book: ProfileBook) -> ranking.Ranking:
    """Each candidate's rank-by-composition time and peak are Auto search's choice's; its bound is below."""
    training = TrainingSpec(32, 5)
    found = ranking.candidates(query("--slots", "4", "--max-layers", "2"))
    target = ranking.Target(cluster, "sim", ParallelSpec(AUTO_SEARCH, (micro,)), micro)
    ranked = ranking.rank_target(target, training, book, (), found, top=3)
    for c in range(len(found)):
        best = choose_plan(target.job(found.model(c), training), book).best()
        assert ranked.seconds[c] == pytest.approx(best.estimate.seconds, rel=1e-9)
        assert abs(ranked.memory[c] - best.estimate.peak_bytes) <= 1
        assert ranked.bound[c] <= best.estimate.seconds * (1 + 1e-9)
    return ranked


def test_random_candidates_cost_the_same_through_estimate_and_the_rankings_path():
    """One cost model: each one-program plan of a candidate, priced by composition over arrays
    (fast_pass.one_programs), is what estimate prices for Workload.of the candidate and the plan:
    its seconds, peak bytes and joules."""
    training, book, rng = TrainingSpec(64, 5, precision="bf16"), ProfileBook(), np.random.default_rng(46)
    found = ranking.candidates(query("--slots", "5", "--max-layers", "3"))
    for cluster, micro in ((ClusterSpec(2, 4, "EFAx4", "sim", "H100"), 4), (ClusterSpec(1, 4, "NVLink", "sim", "cpu"), 2)):
        target = ranking.Target(cluster, "sim", ParallelSpec(AUTO_SEARCH, (micro,)), micro)
        pricer = fast_pass.Pricer(target.job(found.base, training), training, book, (), 1)
        for c in rng.choice(len(found), 12, replace=False):
            block = found.blocks[found.block[c]]
            digits = dict(search.digits(found.index[[c]], [len(search.multisets(n, len(block.kinds)))
                                                           for n in block.layers]))
            seconds, memory, costs = fast_pass.one_programs(pricer, block, [digits[i] for i in range(len(block.layers))],
                                                            found.base)
            job = target.job(found.model(c), training)
            w = Workload.of(job, book.for_job(job))
            for v, variant in enumerate(pricer.variants):
                plan = plan_from_stages(job, [[0]], [list(range(cluster.num_devices))], [(variant.dp, variant.op)],
                                        batch_axis=variant.axis, reduce_scatter=variant.zero)
                priced = estimate(w, plan)
                assert seconds[0, v] == pytest.approx(priced.seconds, rel=1e-9)
                assert memory[0, v] == pytest.approx(priced.peak_bytes, rel=1e-9)
                joules = fast_pass.one_program_joules(pricer, v, costs[v], seconds[:, v])
                assert np.isfinite(priced.energy) and joules[0] == pytest.approx(priced.energy, rel=1e-9)


@pytest.mark.parametrize("cluster", [ClusterSpec(1, 4, "NVLink", "sim", "H100"), ClusterSpec(2, 2, "EFAx4", "sim", "A100")])
@pytest.mark.parametrize("micro", [1, 4])
def test_the_pipeline_bound_is_below_every_pipeline_plan(cluster, micro):
    training, book = TrainingSpec(64, 5), ProfileBook()
    found = ranking.candidates(query("--slots", "4", "--max-layers", "3"))
    target = ranking.Target(cluster, "sim", ParallelSpec(AUTO_SEARCH, (micro,), num_auto_layers=3), micro)
    ranked = ranking.rank_target(target, training, book, (), found, top=3, prune=False)
    pricer = fast_pass.Pricer(target.job(found.base, training), training, book, (), 3)
    deep = [c for c in range(len(found)) if found.model(c).num_zhen_layers == 3][::7]
    for c in deep[:6]:
        block = found.blocks[found.block[c]]
        part = next(p for _, b, p in found.runs() if p.start <= c < p.stop)
        terms = fast_pass.fast_pass(pricer, block, found.index[part], found.base).terms[[c - part.start]]
        bound = fast_pass.pipeline_bound(pricer, terms, np.array([3]))[0]
        job = target.job(found.model(c), training)
        w = Workload.of(job, book.for_job(job))
        pipelines = [estimate(w, plan).seconds for plan in all_plans(job) if len(plan.stages) > 1]
        assert bound <= min(pipelines) * (1 + 1e-9)
        assert ranked.bound[c] <= ranked.seconds[c] * (1 + 1e-9)


def test_bounds_tightened_in_chunks_rank_as_all_at_once(tmp_path, monkeypatch):
    """TIGHTEN_CHUNK only splits the work: chunked, every candidate keeps its time, plan and
    searched flag, and its bound stays at most its time."""
    config = load_config(config_file(tmp_path, batch=1024, groups=2))
    _, (whole,) = ranking.rank(query(), config, ProfileBook(), lambda c: "sim", top=3, workers=1)
    monkeypatch.setattr(ranking, "TIGHTEN_CHUNK", 7)
    _, (chunked,) = ranking.rank(query(), config, ProfileBook(), lambda c: "sim", top=3, workers=1)
    assert len(whole.seconds) > 7 * 3
    assert np.array_equal(whole.seconds, chunked.seconds) and whole.plans == chunked.plans
    assert np.array_equal(whole.searched, chunked.searched)
    fits = np.isfinite(chunked.seconds)
    assert np.all(chunked.bound[fits] <= chunked.seconds[fits] * (1 + 1e-9))


@pytest.mark.parametrize("device", ["cpu", "H100"])
def test_pruning_keeps_the_unpruned_winners(tmp_path, device):
    config = load_config(config_file(tmp_path, batch=1024, device=device, groups=2))
    _, pruned = ranking.rank(query(), config, ProfileBook(), lambda c: "sim", top=3)
    _, full = ranking.rank(query(), config, ProfileBook(), lambda c: "sim", top=3, prune=False)
    (pruned,), (full,) = pruned, full
    assert pruned.searched.sum() < full.searched.sum()
    assert list(pruned.top(3)) == list(full.top(3))
    assert np.allclose(pruned.seconds[pruned.top(3)], full.seconds[full.top(3)])
    assert [pruned.plans[c] for c in pruned.top(3)] == [full.plans[c] for c in full.top(3)]
    assert np.all(pruned.seconds >= full.seconds * (1 - 1e-9))  # a pruned candidate keeps a real plan's time


def test_targets_ranked_in_worker_processes_rank_as_in_one(tmp_path):
    """Targets spread over worker processes (each sharing prices among the targets it ranks) give
    the figures of one process, in the config's order of targets."""
    path = config_file(tmp_path, batch=64, groups=2)
    path.write_text(path.read_text().replace("num_micro_batches = [2]", "num_micro_batches = [1, 2]") + """
[[cluster_spec]]
num_hosts = 2
num_devices_per_host = 4
transport = "EFAx4"
platform = "sim"
device = "A100"
""")
    config = load_config(path)
    _, alone = ranking.rank(query(), config, ProfileBook(), lambda c: "sim", top=3, workers=1)
    _, parallel = ranking.rank(query(), config, ProfileBook(), lambda c: "sim", top=3, workers=2)
    assert [r.target for r in parallel] == [r.target for r in alone] and len(alone) == 4
    for a, p in zip(alone, parallel):
        assert np.array_equal(a.seconds, p.seconds) and np.array_equal(a.bound, p.bound)
        assert a.plans == p.plans and np.array_equal(a.searched, p.searched)


def test_the_toml_loads_as_a_config_and_the_csv_holds_every_candidate(tmp_path):
    path = config_file(tmp_path)
    code, stdout, stderr = cli("search", "--rank", "-c", str(path), "-d", str(tmp_path / "none.db"),
                               "--csv", str(tmp_path / "rank.csv"), "--top", "4", *SMALL)
    assert code == 0, stderr
    (tmp_path / "ranked.toml").write_text(re.sub(r"\[\[model\]\].*?tokens = \[\"DOT\"\]\n", "", path.read_text(), flags=re.DOTALL) + stdout)
    models = load_config(tmp_path / "ranked.toml").models
    table = pd.read_csv(tmp_path / "rank.csv")
    best = table.sort_values("rank").head(4)
    assert [m.summary() for m in models] == list(best["model"])
    assert len(table) == len(ranking.candidates(query())) and "rank.csv" in stderr
    assert "# rank 1: " in stdout and f"plan: {best['plan'].iloc[0]}" in stdout
    again = cli("search", "--rank", "-c", str(path), "-d", str(tmp_path / "none.db"),
                "--csv", str(tmp_path / "again.csv"), "--top", "4", *SMALL)
    assert again[1] == stdout and (tmp_path / "again.csv").read_text() == (tmp_path / "rank.csv").read_text()


def test_a_candidate_that_fits_nothing_says_why(tmp_path):
    path = config_file(tmp_path, batch=4_000_000, device="cpu", groups=2)
    code, _, stderr = cli("search", "--rank", "-c", str(path), "--csv", str(tmp_path / "rank.csv"),
                          "-d", str(tmp_path / "none.db"), *SMALL)
    assert code == 0, stderr
    table = pd.read_csv(tmp_path / "rank.csv")
    one_layer = table[table["num_zhen_layers"].eq(1)]
    assert (one_layer["reason"] == "num_auto_layers = 2 layer groups, but the model has only 1 layers").all()
    deeper = table[table["num_zhen_layers"].gt(1)]
    assert deeper["reason"].str.startswith("no plan fits: the smallest predicted peak is").all()
    assert table["rank"].isna().all() and table["predicted_samples_per_s"].isna().all()


TWO_CLUSTERS = """
[[cluster_spec]]
num_hosts = 1
num_devices_per_host = 4
transport = "NVLink"
platform = "sim"
device = "cpu"
"""


def ranked_csv(tmp_path, groups: int) -> tuple:
    """A ranking's CSV on a 4-GPU and a 4-CPU-device cluster, with its config."""
    path = config_file(tmp_path, batch=64, groups=groups)
    path.write_text(path.read_text() + TWO_CLUSTERS)
    code, _, stderr = cli("search", "--rank", "-c", str(path), "-d", str(tmp_path / "none.db"),
                          "--csv", str(tmp_path / "rank.csv"), *SMALL)
    assert code == 0, stderr
    return pd.read_csv(tmp_path / "rank.csv"), load_config(path)


def listed_plan(job, row):
    """The plan a CSV row names, rebuilt: Auto search's choice, or the one-program plan of that name."""
    if row["searched"] == "full":
        plan = choose_plan(job, ProfileBook()).best().plan
        assert plan_name(plan) == row["plan"]
        return plan
    pricer = fast_pass.Pricer(job, job.training, ProfileBook(), (), job.parallel.num_auto_layers)
    (variant,) = [v for v in pricer.variants if v.name() == row["plan"]]
    return plan_from_stages(job, [list(range(job.parallel.num_auto_layers))], [list(range(job.cluster.num_devices))],
                            [(variant.dp, variant.op)], batch_axis=variant.axis, reduce_scatter=variant.zero)


@pytest.mark.parametrize("groups", [1, 2])
def test_the_csvs_samples_per_joule_are_its_plans_estimates(tmp_path, groups):
    table, config = ranked_csv(tmp_path, groups)
    assert list(table.columns) == list(ranking.COLUMNS) and list(table.columns[-3:]) == ["samples_per_joule",
                                                                                         "energy_frontier", "gemms"]
    found = ranking.candidates(query())
    targets = {t.cluster.summary(): t for t in ranking.targets(config, lambda c: "sim")}
    priced = table[table["rank"].notna()]
    assert len(priced) > 50 and set(priced["searched"]) >= ({"full"} if groups == 1 else {"full", "one-program"})
    for i, row in priced.iterrows():
        job = targets[row["cluster"]].job(found.model(i % len(found)), config.training)
        assert job.model.summary() == row["model"]
        energy = estimate(Workload.of(job, ProfileBook().for_job(job)), listed_plan(job, row)).energy
        assert row["samples_per_joule"] == pytest.approx(job.global_batch / energy, rel=1e-5)
    assert table.loc[table["rank"].isna(), "samples_per_joule"].isna().all()


@pytest.mark.parametrize("flag, figures", [("energy_frontier", ["predicted_samples_per_s", "samples_per_joule"]),
                                           ("pareto", ["params", "predicted_samples_per_s"])])
def test_the_frontiers_are_what_no_other_row_beats_on_both(tmp_path, flag, figures):
    table, _ = ranked_csv(tmp_path, groups=2)
    for _, rows in table.groupby(["cluster", "micro_batches"]):
        points = rows[figures].to_numpy(float)
        on = [bool(np.isfinite(p).all()) and not any(np.all(q >= p) and np.any(q > p) for q in points)
              for p in points]
        assert rows[flag].astype(bool).tolist() == on and 0 < sum(on) < len(on)


def test_pareto_marks_what_nothing_beats_on_both():
    params = np.array([10, 20, 20, 30, 5, 30.0])
    speed = np.array([5, 4, 6, 1, 9, np.nan])
    assert objective.pareto(params, speed).tolist() == [False, False, True, True, True, False]
    twins = np.array([20, 10, 20, 20.0]), np.array([6, 9, 6, 5.0])  # neither of two equals beats the other
    assert objective.pareto(*twins).tolist() == [True, True, True, False]


def test_the_report_section_is_the_csvs(tmp_path):
    path = config_file(tmp_path)
    code, _, stderr = cli("search", "--rank", "-c", str(path), "-d", str(tmp_path / "none.db"),
                          "--csv", str(tmp_path / "rank.csv"), *SMALL)
    assert code == 0, stderr
    table = pd.read_csv(tmp_path / "rank.csv")
    ran = table.sort_values("rank").head(6).index
    table.loc[ran, "measured_samples_per_s"] = table.loc[ran, "predicted_samples_per_s"] * [1, 1.1, 0.7, 0.8, 0.5, 0.6]
    table.to_csv(tmp_path / "rank.csv", index=False)
    Store(tmp_path / "r.db").close()
    code, _, stderr = cli("report", "-d", str(tmp_path / "r.db"), "-o", str(tmp_path / "out"),
                          "--codesign", str(tmp_path / "rank.csv"))
    assert code == 0, stderr
    page = Page((tmp_path / "out" / "report.html").read_text())
    section = page.sections["codesign"]
    assert not section["empty"] and len(section["images"]) == 3  # the ranking, agreement, time-energy frontier
    (agree,) = page.rows("codesign", 0)
    rho = spearmanr(table.loc[ran, "predicted_samples_per_s"], table.loc[ran, "measured_samples_per_s"]).statistic
    assert float(agree["Spearman"]) == pytest.approx(rho, abs=1e-3) and agree["runs"] == "6"
    best = table.loc[ran, "measured_samples_per_s"]
    assert agree["predicted best / measured best"] == f"{100 * best.iloc[0] / best.max():.1f}%"
    frontier = page.rows("codesign", 1)
    assert [r["model"] for r in frontier] == list(table[table["pareto"].eq(1)].sort_values("params", ascending=False)["model"])


def test_a_report_without_a_ranking_says_why(tmp_path):
    Store(tmp_path / "r.db").close()
    code, _, stderr = cli("report", "-d", str(tmp_path / "r.db"), "-o", str(tmp_path / "out"))
    assert code == 0, stderr
    empty = Page((tmp_path / "out" / "report.html").read_text()).sections["codesign"]["empty"]
    assert "codesign search --rank" in empty
    code, _, stderr = cli("report", "-d", str(tmp_path / "r.db"), "--codesign", str(tmp_path / "no.csv"))
    assert code == 2 and "no.csv" in stderr


@pytest.mark.parametrize("flags, digest", [
    ((), "b29a8cd487e7ca50deea350dc6b1ccb70adc910375ff7874a5671c0cebe04204"),
    (("--seed", "3", "--num-layers", "2"), "93db305b4fed47d225114cf7e1e16a7a86febae983207ff290313d4f5fea15f4")])
def test_search_model_prints_what_it_printed_before(flags, digest):
    code, stdout, _ = cli("--search-model", *flags)
    assert code == 0 and hashlib.sha256(stdout.encode()).hexdigest() == digest


def test_run_top_must_not_be_negative(tmp_path):
    code, _, stderr = cli("search", "--rank", "-c", str(config_file(tmp_path)), "--run-top", "-1", *SMALL)
    assert code == 2 and "--run-top" in stderr


