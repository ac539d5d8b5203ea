"""Where jobs are enumerated from a config and keyed for the results DB."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterator

from codesign.config import Config
from codesign.devices import Hosts, resolve_platform
from codesign.specs import ClusterSpec, Job, ParallelSpec

KEY_VERSION = 1


@dataclass(frozen=True)
class PlannedJob:
    job: Job
    unavailable: str = ""  # why the hosts cannot provide the job's cluster; "" when it can

    @property
    def key(self) -> str:
        return job_key(self.job)


def matches(parallel: ParallelSpec, cluster: ClusterSpec) -> bool:
    """Auto search fits every cluster; a manual plan needs exactly pp * dp * op devices."""
    if parallel.is_auto:
        return True
    pp, dp, op = parallel.pp_dp_op
    return pp * dp * op == cluster.num_devices


def enumerate_jobs(config: Config, hosts: Hosts) -> Iterator[PlannedJob]:
    """cluster x model x matched parallel spec x micro-batch value, in that nesting order."""
    for cluster in config.clusters:
        platform, why_not = resolve_platform(cluster, hosts)
        for model in config.models:
            for parallel in config.parallels:
                if not matches(parallel, cluster):
                    continue
                for micro_batches in parallel.num_micro_batches:
                    job = Job(model, cluster, config.training, parallel, micro_batches,
                              platform or cluster.platform)
                    yield PlannedJob(job, why_not)


def job_key(job: Job) -> str:
    """sha256 of the canonical JSON of what the job runs (declared platform and list of
    micro-batch values excluded: they choose jobs, they are not part of one)."""
    data = job.to_dict()
    data["cluster"].pop("platform")
    data["parallel"].pop("num_micro_batches")
    data["key_version"] = KEY_VERSION
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def job_timeout(job: Job, manual_timeout: float) -> float:
    """Manual plans get the user's timeout; Auto search scales with the GPU count."""
    if not job.parallel.is_auto:
        return manual_timeout
    n = job.cluster.num_devices
    for at_least, seconds in ((64, 6000), (32, 3000), (16, 2000), (8, 1500)):
        if n >= at_least:
            return seconds
    return 1000
