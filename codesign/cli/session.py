"""The setup every command shares: the Ray connection, the hosts jobs run on, the profiles that
price them, the executor, and JAX's compilation cache. Commands differ only in which of these
they ask for; the rules live here once."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from codesign.config.hosts import Hosts
from codesign.config.loader import Config
from codesign.errors import ConfigError, UserError
from codesign.store.database import Store

if TYPE_CHECKING:
    from codesign.hardware.profiles import ProfileBook
    from codesign.run.profile_cache import Profiles
    from codesign.run.sweep import Executor

MANUAL_JOB_TIMEOUT = 600  # seconds; the earlier toolkit's default for jobs with a manual parallel spec


@dataclass(frozen=True)
class RunOptions:
    """How a sweep runs its jobs: `codesign run`'s flags, and `search --run-top`'s defaults."""

    retry_failed: bool = False
    manual_job_timeout: float = MANUAL_JOB_TIMEOUT
    max_concurrent: int | None = None  # None: on Ray, [ray] max_concurrent; here, the executor's rules
    verbose: bool = False  # stream each job's output


@dataclass(frozen=True)
class Session:
    """Where a command's jobs run and what prices them: a Ray cluster's nodes when there is an
    address, else this machine."""

    config: Config
    db: str
    address: str | None
    hosts: Hosts
    profiles: Profiles

    def executor(self, options: RunOptions) -> Executor:
        if self.address:
            from codesign.run.ray_cluster import RayExecutor

            return RayExecutor(jax_cache(self.db))
        from codesign.run.local import LocalExecutor

        return LocalExecutor(jax_cache(self.db), gpus=range(self.hosts.gpus[0]),
                             cpu_slots=options.max_concurrent or 1, stream=options.verbose)

    def max_concurrent(self, options: RunOptions) -> int | None:
        """The flag, else on Ray the config's cap or none (its resources decide); here, the
        executor's rules (GPU jobs on disjoint GPUs, CPU jobs one at a time)."""
        if options.max_concurrent:
            return options.max_concurrent
        return self.config.ray.max_concurrent if self.address else None


@contextlib.contextmanager
def session(config: Config, db: str, address: str | None, learning: bool = True) -> Iterator[Session]:
    """The command's session, connected to the Ray cluster throughout where there is an address;
    a simulated cluster's device kind is checked before anything runs. `learning`: this machine's
    calibration is used and refitted (run.learning)."""
    with ray_session(address):
        hosts = config_hosts(config, address)
        found = Session(config, db, address, hosts, profiles(hosts, db, address, learning))
        check_devices(config, found.profiles.book)
        yield found


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """Connected to the Ray cluster for the whole command when there is an address."""
    if not address:
        yield
        return
    try:
        from codesign.run import ray_cluster
    except ImportError as err:
        raise UserError(f"running on Ray needs it installed (pip install 'codesign[ray]'): {err}") from None
    ray_cluster.connect(address)
    try:
        yield
    finally:
        ray_cluster.disconnect()


def config_hosts(config: Config, address: str | None) -> Hosts:
    """The Ray cluster's nodes, or this machine (probed for GPUs only when a cluster could use them)."""
    from codesign.run import discovery

    if address:
        return discovery.ray_hosts(address)
    return discovery.local_hosts(any(c.platform in ("gpu", "auto") for c in config.clusters))


def profiles(hosts: Hosts, db: str, address: str | None, learning: bool = True) -> Profiles:
    """The profiles a command prices with: built-in, the DB's measured copies, this machine's cache
    (under its latest calibration, where learning)."""
    from codesign.run.profile_cache import profiles_for

    store = Store.open_if_exists(db)
    try:
        return profiles_for(hosts, store, on_ray=bool(address), jax_cache=jax_cache(db), learning=learning)
    finally:
        if store:
            store.close()


def check_devices(config: Config, book: ProfileBook) -> None:
    """A simulated cluster must name a device kind the cost model has a profile for."""
    for i, cluster in enumerate(config.clusters):
        if cluster.is_simulated and not book.known(cluster.device):
            raise ConfigError(config.path, f"[[cluster_spec]] #{i + 1}", "device",
                              f"unknown device kind {cluster.device!r}; known kinds: {', '.join(book.kinds)} "
                              f"(or run `codesign profile` on the device)")


def jax_cache(db: str) -> str:
    """JAX's compilation cache for the jobs: JAX's own JAX_COMPILATION_CACHE_DIR where the user
    set one (one cache for every DB), else jax_cache/ beside the DB."""
    return jax_cache_in(Path(db).resolve().parent)


def jax_cache_in(folder: Path) -> str:
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(folder / "jax_cache")
