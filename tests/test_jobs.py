import dataclasses

from codesign.config.loader import load_config
from codesign.config.hosts import Hosts
from codesign.config.jobs import enumerate_jobs, job_key, job_timeout


def test_fixture_config_enumerates_46_jobs_in_nesting_order(fixture_config):
    planned = list(enumerate_jobs(load_config(fixture_config), Hosts.local(0)))
    assert len(planned) == 46
    devices = [p.job.cluster.num_devices for p in planned]
    assert devices == sorted(devices, key=[1, 8, 16, 64].index)  # clusters outermost
    per_cluster = {n: devices.count(n) for n in (1, 8, 16, 64)}
    assert per_cluster == {1: 6, 8: 6, 16: 27, 64: 7}
    assert len({p.key for p in planned}) == 46
    first16 = [p.job for p in planned if p.job.cluster.num_devices == 16]
    assert [j.num_micro_batches for j in first16[:6]] == [1, 2, 4, 1, 2, 4]  # micro-batches innermost
    assert all(p.job.global_batch == 1024 * p.job.cluster.num_devices for p in planned)


def test_unavailable_clusters_say_why(fixture_config):
    planned = list(enumerate_jobs(load_config(fixture_config), Hosts.local(8)))
    reasons = {p.job.cluster.num_devices: p.unavailable for p in planned}
    assert reasons[1] == "" and reasons[8] == ""
    assert reasons[16] == "needs 2 GPU hosts; this machine is one host"
    assert {p.job.platform for p in planned if not p.unavailable} == {"gpu"}


def test_manual_plans_match_only_their_device_count(fixtures_dir):
    config = load_config(fixtures_dir / "uniform_model.toml")
    planned = list(enumerate_jobs(config, Hosts.local(0)))
    assert all(p.job.parallel.pp_dp_op[1] == p.job.cluster.num_devices for p in planned)
    assert len(planned) == 2 * len(config.models)


def test_keys_are_stable_and_ignore_the_declared_platform(fixture_config):
    config = load_config(fixture_config)
    a = next(iter(enumerate_jobs(config, Hosts.local(1))))
    b = next(iter(enumerate_jobs(config, Hosts.local(1))))
    assert a.key == b.key and len(a.key) == 64
    import dataclasses
    auto = dataclasses.replace(a.job, cluster=dataclasses.replace(a.job.cluster, platform="auto"))
    assert job_key(auto) == a.key
    on_cpu = dataclasses.replace(a.job, platform="cpu")
    assert job_key(on_cpu) != a.key


def test_timeouts_manual_and_scaled_auto(fixture_config):
    planned = list(enumerate_jobs(load_config(fixture_config), Hosts.local(0)))
    auto = {p.job.cluster.num_devices: job_timeout(p.job, 600) for p in planned if p.job.parallel.is_auto}
    assert auto == {1: 1000, 8: 1500, 16: 2000, 64: 6000}
    manual = {job_timeout(p.job, 42) for p in planned if not p.job.parallel.is_auto}
    assert manual == {42}



def test_auto_trials_at_its_default_leaves_the_key_unchanged(fixture_config):
    """An Auto search job keeps the key it had before auto_trials existed (pinned below, key
    version 2) until its config sets auto_trials."""
    auto = next(p for p in enumerate_jobs(load_config(fixture_config), Hosts.local(1)) if p.job.parallel.is_auto)
    assert auto.job.parallel.auto_trials == 1
    assert auto.key == "634b7a04ae23041dfee46c59fb36721ff8346834a7d057376da3f41e11985c05"
    three = dataclasses.replace(auto.job, parallel=dataclasses.replace(auto.job.parallel, auto_trials=3))
    assert job_key(three) != auto.key
    timed = dataclasses.replace(auto.job, training=dataclasses.replace(auto.job.training, min_measured_seconds=1.0))
    assert auto.job.training.min_measured_seconds == 0 and job_key(timed) != auto.key
