"""Where jobs are enumerated from a config and keyed for the results DB."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterator

from codesign.config.loader import Config
from codesign.config.hosts import Hosts, resolve_platform
from codesign.config.types import ClusterSpec, Job, ParallelSpec

KEY_VERSION = 2  # 2: optional fields at their defaults left out (schema v3 re-keys older DBs)


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
    """sha256 of the job's canonical JSON: what it runs, with optional fields at their defaults
    left out, so that adding an optional spec field later does not re-key existing DBs. The
    declared platform and the list of micro-batch values choose jobs; they are not part of one."""
    parts = {"model": _declared_json(job.model), "cluster": _declared_json(job.cluster, "platform"),
             "training": _declared_json(job.training),
             "parallel": _declared_json(job.parallel, "num_micro_batches"),
             "num_micro_batches": json.dumps(job.num_micro_batches), "platform": json.dumps(job.platform),
             "key_version": json.dumps(KEY_VERSION)}
    # json.dumps(..., sort_keys=True) of the whole, assembled from parts cached per spec: a dry
    # run keys 100,000 jobs that share a few hundred specs.
    canonical = "{" + ",".join(f'"{name}":{part}' for name, part in sorted(parts.items())) + "}"
    return hashlib.sha256(canonical.encode()).hexdigest()


@functools.lru_cache(maxsize=4096)
def _declared_json(spec: Any, *excluded: str) -> str:
    """A spec's canonical JSON: its fields, less the excluded ones and the optional ones left at
    their defaults."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
              if f.name not in excluded
              and (f.default is dataclasses.MISSING or getattr(spec, f.name) != f.default)}
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def job_timeout(job: Job, manual_timeout: float) -> float:
    """Manual plans get the user's timeout; Auto search scales with the GPU count."""
    if not job.parallel.is_auto:
        return manual_timeout
    n = job.cluster.num_devices
    for at_least, seconds in ((64, 6000), (32, 3000), (16, 2000), (8, 1500)):
        if n >= at_least:
            return seconds
    return 1000
