"""bench/bench_auto.py's confirming rounds: which jobs run again, in what order, and the ratio."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

from codesign.config.loader import load_config
from codesign.config.hosts import Hosts
from codesign.config.jobs import enumerate_jobs
from codesign.config.types import AUTO_SEARCH
from tests.conftest import REPO


@pytest.fixture(scope="module")
def bench_auto():
    spec = importlib.util.spec_from_file_location("bench_auto", REPO / "bench" / "bench_auto.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setitem(sys.modules, "bench_auto", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    monkeypatch.undo()


def recorded(p, median: float, status: str = "succeeded") -> dict:
    """An attempt row of a planned job, as groups() reads it."""
    job = p.job
    return {"job_key": p.key, "status": status, "median": median, "predicted_time": 1.0, "pp_dp_op": "[]",
            "description": job.parallel.description, "num_auto_layers": job.parallel.num_auto_layers,
            "all_configs": json.dumps({"parallel": {"description": job.parallel.description,
                                                    "auto_trials": job.parallel.auto_trials}}),
            "input_features": job.model.num_features, "num_zhen_layers": job.model.num_zhen_layers,
            "token_mixer": "mixed", "num_nodes": job.cluster.num_hosts,
            "gpus_per_node": job.cluster.num_devices_per_host, "num_micro_batches": job.num_micro_batches}


def test_confirming_rounds_rerun_each_groups_auto_and_best_manual_plan_in_turn(bench_auto, tmp_path):
    path = tmp_path / "auto.toml"
    path.write_text(bench_auto.config_text(["tiny"], [2], [1, 2], 3, 8))
    planned = list(enumerate_jobs(load_config(path), Hosts.local(0)))
    first = {p.key: 1.0 if p.job.parallel.description == AUTO_SEARCH else
             {"pp1 dp2 op1": 0.5, "pp2 dp1 op1": 0.8}.get(p.job.parallel.description, 2.0) for p in planned}
    rows = [recorded(p, first[p.key]) for p in planned]
    best = bench_auto.report(rows, 1)
    assert sorted(pair.ratio for pair in best.values()) == [2.0, 2.0]
    assert {pair.best["description"] for pair in best.values()} == {"pp1 dp2 op1"}  # the first pass's fastest

    calls: list[tuple[list[str], Path]] = []
    again = iter([{AUTO_SEARCH: 1.0, "pp1 dp2 op1": 0.8}, {AUTO_SEARCH: 3.0, "pp1 dp2 op1": 1.2},
                  {AUTO_SEARCH: 1.1, "pp1 dp2 op1": 1.0}])

    def run(jobs, db):
        calls.append(([f"{j.job.parallel.description}/{j.job.num_micro_batches}" for j in jobs], db))
        times = next(again)
        return [recorded(j, times[j.job.parallel.description]) for j in jobs]

    found = bench_auto.confirmed(planned, best, 3, run, tmp_path / "confirm")
    order = ["Auto search/1", "pp1 dp2 op1/1", "Auto search/2", "pp1 dp2 op1/2"]
    assert [jobs for jobs, _ in calls] == [order, order[::-1], order]  # the two in turn, reversed each round
    assert len({db for _, db in calls}) == 3  # a fresh DB each round: nothing skipped as recorded
    ratio = statistics.median([1.0, 3.0, 1.1]) / statistics.median([0.8, 1.2, 1.0])
    assert list(found.values()) == pytest.approx([ratio, ratio])  # those rounds alone, not the first pass's 2.0
