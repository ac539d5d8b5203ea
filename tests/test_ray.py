"""Sweeps on a two-node Ray cluster on loopback: a job spanning both hosts, and faults."""

import dataclasses
import json
import os
import time
from types import SimpleNamespace

# Ray would otherwise bind its nodes to this machine's outward-facing address; keep it on
# 127.0.0.1 (read when ray is imported, and inherited by the nodes this module starts).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import psutil  # noqa: E402
import pytest  # noqa: E402

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

from codesign.run import ray_cluster  # noqa: E402
from codesign.run.discovery import ray_hosts  # noqa: E402
from codesign.run.local import LocalExecutor  # noqa: E402
from codesign.run.ray_cluster import RayExecutor  # noqa: E402
from codesign.run.sweep import run_sweep  # noqa: E402
from codesign.config.hosts import resolve_platform  # noqa: E402
from codesign.config.jobs import PlannedJob  # noqa: E402
from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec  # noqa: E402
from codesign.store.database import Store  # noqa: E402
from tests.conftest import REPO, SMALL_CONFIG, run_cli  # noqa: E402
from tests.fault_trials import fault_job  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.drills]  # a two-node Ray cluster: seconds to start, half a minute of jobs
NODE = {"num_cpus": 2, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20}
LOSS_TOL = 1e-5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two Ray nodes of 2 CPUs on 127.0.0.1; their job bodies can import tests.fault_jobs."""
    pids = tmp_path_factory.mktemp("ray") / "pids"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(REPO))
        env.setenv("FAULT_PIDS", str(pids))
        nodes = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
        try:
            nodes.add_node(**NODE)
            ray_cluster.connect(nodes.address)
            yield nodes, pids
        finally:
            ray_cluster.disconnect()
            nodes.shutdown()


def two_host_job() -> Job:
    model = ModelSpec(16, 8, 4, 2, (("ATTENTION", "LINEAR", "DOT", "CONVOLUTION"), ("DOT", "ATTENTION")))
    parallel = ParallelSpec("data parallel over 2 hosts", (1,), 1, False, (1, 4, 1))
    return Job(model, ClusterSpec(2, 2, "TCPx4", "cpu"), TrainingSpec(8, 4), parallel, 1, "cpu")


def resources_freed(total_cpus: float = 4.0, within: float = 20.0) -> bool:
    """Every CPU back and every placement group removed, polled for a bounded time."""
    until = time.monotonic() + within
    while time.monotonic() < until:
        groups = ray.util.placement_group_table().values()
        if (ray.available_resources().get("CPU") == total_cpus
                and all(g["state"] == "REMOVED" for g in groups)):
            return True
        time.sleep(0.5)
    return False


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_cluster_counts_as_two_cpu_hosts(cluster):
    nodes, _ = cluster
    hosts = ray_hosts(nodes.address)
    assert hosts.gpus == (0, 0)
    assert resolve_platform(ClusterSpec(2, 2, "TCPx4", "cpu"), hosts) == ("cpu", "")
    assert resolve_platform(ClusterSpec(3, 1, "TCPx4", "cpu"), hosts)[1].startswith("needs 3 hosts; the Ray")
    assert resolve_platform(ClusterSpec(1, 1, "NVLink", "gpu"), hosts)[1] == \
        f"needs 1 host(s) with 1 GPUs; the Ray cluster at {nodes.address} has 0"


def test_two_host_data_parallel_job_matches_the_single_process_reference(cluster, tmp_path):
    """Timed for min_measured_seconds: both processes run host 0's count of extra steps (were
    they to disagree, one would wait in a collective until the timeout). 3 s: far more than the
    job's 3 timed steps take even on a loaded machine (at 1 s, beside another test's compiles,
    they already took over 1 s and no extra step ran)."""
    job = dataclasses.replace(two_host_job(), training=TrainingSpec(8, 4, min_measured_seconds=3.0))
    reference_store = Store(tmp_path / "reference.db")
    run_sweep([PlannedJob(job)], reference_store, LocalExecutor(), retry_failed=False, manual_timeout=300)
    (reference,) = reference_store.attempts()
    assert reference["status"] == "succeeded", reference["error"]
    store = Store(tmp_path / "r.db")
    start = time.monotonic()
    summary = run_sweep([PlannedJob(job)], store, RayExecutor(), retry_failed=False,
                        manual_timeout=300, max_concurrent=None)
    row = store.attempts()[0]
    assert summary.statuses == {"succeeded": 1}, row["error"]
    losses = json.loads(row["all_configs"])["losses"]
    steps = job.training.num_iters  # the extra steps' count follows each run's own pace, and fp32 sums in
    # another order drift apart over them (2.1e-5 after 19): the configured steps are the check
    diff = max(abs(a - b) for a, b in zip(losses[:steps], json.loads(reference["all_configs"])["losses"][:steps]))
    print(f"2-host losses {losses}, max |diff| vs 1 process {diff:.2e}, "
          f"{time.monotonic() - start:.1f} s on Ray")
    assert len(losses) > 4 and losses[-1] < losses[0] and diff < LOSS_TOL
    assert json.loads(row["all_configs"])["plan"]["stages"][0]["device_ids"] == [0, 1, 2, 3]
    assert resources_freed()


def test_timeout_and_killed_actor_are_recorded_and_the_next_jobs_run(cluster, tmp_path):
    _, pids = cluster
    pids.unlink(missing_ok=True)
    store = Store(tmp_path / "r.db")
    order = ("hang", "ok", "kill-actor", "ok2")
    summary = run_sweep([fault_job(b) for b in order], store, RayExecutor(job_module="tests.fault_jobs"),
                        retry_failed=False, manual_timeout=6, max_concurrent=1, logs=tmp_path / "logs")
    rows = {r["description"]: r for r in store.attempts()}
    assert [rows[b]["status"] for b in order] == ["timeout", "succeeded", "failed", "succeeded"]
    assert summary.statuses == {"timeout": 1, "succeeded": 2, "failed": 1}
    assert "killed after the 6 s timeout" in rows["hang"]["error"]
    for b in ("hang", "ok"):  # every host's output comes back to the log beside the DB, a timed-out job's too
        log = tmp_path / "logs" / rows[b]["job_key"] / f"{rows[b]['id']}.log"
        assert rows[b]["log_path"] == str(log) and log.read_text().startswith("## host 0 (node ")
    assert 6 <= rows["hang"]["job_duration"] < 30
    assert "the actor of host 0 died" in rows["kill-actor"]["error"]
    hang, killed = (list(map(int, line.split())) for line in pids.read_text().splitlines())
    for pid in (*hang, killed[0], killed[2]):  # job bodies and grandchildren, the killed actor's too
        assert gone(pid), pid
    assert resources_freed()


def test_independent_jobs_run_at_once_where_resources_allow(cluster, tmp_path):
    _, pids = cluster
    pids.unlink(missing_ok=True)
    pids.with_name(pids.name + ".started").unlink(missing_ok=True)
    store = Store(tmp_path / "r.db")
    jobs = [fault_job(f"meet 2 {i}") for i in range(3)]
    summary = run_sweep(jobs, store, RayExecutor(job_module="tests.fault_jobs"), retry_failed=False,
                        manual_timeout=60, max_concurrent=2)
    assert summary.statuses == {"succeeded": 3}
    spans = sorted(tuple(map(float, line.split()[:2])) for line in pids.read_text().splitlines())
    assert spans[1][0] < spans[0][1]  # the first two overlapped
    assert resources_freed()


def test_cli_runs_the_sweep_on_the_cluster_from_the_ray_table(cluster, tmp_path):
    nodes, _ = cluster
    config = SMALL_CONFIG + f'\n[ray]\naddress = "{nodes.address}"\nmax_concurrent = 2\n'
    (tmp_path / "c.toml").write_text(config)
    dry = run_cli("-D", "-c", "c.toml", cwd=tmp_path, timeout=120)
    assert "2 jobs: 2 run, 0 skip, 0 running, 0 unavailable" in dry.stdout, dry.stderr[-2000:]
    proc = run_cli("-c", "c.toml", "--max-concurrent", "1", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attempted: 1 invalid, 1 succeeded" in proc.stderr
    assert resources_freed()


def test_an_unreachable_ray_address_is_a_usage_error(tmp_path):
    (tmp_path / "c.toml").write_text(SMALL_CONFIG)
    proc = run_cli("-c", "c.toml", "--ray-address", "127.0.0.1:1", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "cannot connect to the Ray cluster at 127.0.0.1:1" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "results.db").exists()


def test_a_dead_actor_on_a_lost_node_records_interrupted(cluster):
    alive = ray.nodes()[0]["NodeID"]
    err = ray.exceptions.RayActorError(error_msg="The actor died unexpectedly")
    lost = ray_cluster._actor_lost(SimpleNamespace(nodes={0: alive, 1: "f" * 56}), 1, err)
    assert lost.status == "interrupted" and "node ffffffffffff of host 1 was lost" in lost.error
    died = ray_cluster._actor_lost(SimpleNamespace(nodes={0: alive}), 0, err)
    assert died.status == "failed" and "the actor of host 0 died" in died.error
