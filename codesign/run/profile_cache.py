"""The device profiles a command prices with: built-in ones, overlaid with this machine's measured ones.

Measured profiles are kept per machine in the user's cache directory (XDG), keyed by device
kind, host (CPU model and core count; for GPUs their count) and library versions, and shared
by every DB and by `codesign plan`. Nothing waits on a profile it does not need: manual jobs are
priced by the best profile at hand, and only an Auto search job whose devices have no measured
profile has one measured, once, right before it starts (`Profiles.measured_for`). Measuring runs
`python -m codesign.engine.probe` under the job guard (no process outlives the orchestrator),
with a timeout; a failure says so in one line and the built-in profile prices instead.
CODESIGN_PROFILE=builtin never measures and ignores cached profiles (the tests set it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import platformdirs

from codesign.hardware.profiles import DeviceProfile, ProfileBook, builtin_kind, library_versions
from codesign.config.hosts import Hosts
from codesign.run.device_env import device_env
from codesign.run.durable import write_atomically
from codesign.run.learning import Learner, learning_enabled
from codesign.store.database import Store

log = logging.getLogger(__name__)
CPU_PROFILE_DEVICES = 8
PROFILE_MODULE = "codesign.engine.probe"  # `python -m MODULE OUT.json` measures (tests swap in a fake)
# Seconds before measuring gives up, in a sweep and in `codesign profile` alike; the environment may override it.
PROFILE_TIMEOUT = float(os.environ.get("CODESIGN_PROFILE_TIMEOUT", 300))
POLL_EVERY = 0.1


@dataclass(frozen=True)
class Machine:
    """What a measured profile is kept under: it holds for these devices, this host, these libraries."""

    platform: str  # "cpu" | "gpu"
    device_kind: str
    host: str  # CPU model and core count; for GPUs, how many this host has
    versions: tuple[tuple[str, str], ...]

    @property
    def key(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __str__(self) -> str:
        return f"{self.platform} devices ({self.device_kind}, {self.host})"


def this_machine(platform: str, hosts: Hosts) -> Machine:
    """The local devices of a platform as the profile cache knows them."""
    from codesign.run.discovery import cpu_model

    versions = tuple(sorted(library_versions().items()))
    if platform == "gpu":
        return Machine("gpu", hosts.gpu_kind or "gpu", f"{hosts.gpus[0]} GPU(s)", versions)
    return Machine("cpu", "cpu", cpu_model(), versions)


class ProfileCache:
    """One JSON file per machine key under the user's cache directory; written atomically and durably."""

    def __init__(self, root: Path | None = None):
        self.root = root or Path(platformdirs.user_cache_dir("codesign")) / "profiles"

    def path(self, machine: Machine) -> Path:
        return self.root / f"{machine.key}.json"

    def load(self, machine: Machine) -> DeviceProfile | None:
        """The machine's cached profile; None where there is none, or (said once) it does not read."""
        path = self.path(machine)
        try:
            return DeviceProfile.from_dict(json.loads(path.read_text())["profile"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            log.warning("%s: unreadable cached profile of the %s skipped (%s: %s)", path, machine,
                        type(err).__name__, err)
            return None

    def save(self, machine: Machine, profile: DeviceProfile) -> Path:
        path = self.path(machine)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"machine": dataclasses.asdict(machine), "created": time.time(), "profile": profile.to_dict()}
        write_atomically(path, json.dumps(data))
        return path


def measure(machine: Machine, cache: ProfileCache, jax_cache: str | None = None,
            timeout: float | None = None, check_stop: Callable[[], None] = lambda: None) -> DeviceProfile | None:
    """Measure this machine's devices of a platform in a guarded child (its progress on stderr)
    and keep the profile in the cache; None, after one line saying what failed, when it fails or
    overstays. The child saves its sections as they come (OUT.json.parts), so a rerun resumes."""
    from codesign.run.local import GuardedProcess

    env = device_env(dict(os.environ, PYTHONUNBUFFERED="1"), machine.platform, CPU_PROFILE_DEVICES)
    if jax_cache:
        env["CODESIGN_CACHE_DIR"] = jax_cache
    out = cache.root / f"{machine.key}.measuring.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    limit = PROFILE_TIMEOUT if timeout is None else timeout
    print(f"codesign: measuring the {machine} for the cost model (at most {limit:g} s)...", file=sys.stderr)
    process = GuardedProcess([PROFILE_MODULE, str(out)], env)
    try:
        code = _wait(process, limit, check_stop)
    finally:
        process.kill()
    problem = (f"timed out after {limit:g} s" if code is None
               else f"exited with code {code}" if code != 0 or not out.exists() else "")
    if not problem:
        try:
            profile = DeviceProfile.from_dict(json.loads(out.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as err:
            problem = f"wrote an unreadable profile ({err})"
    if problem:
        print(f"codesign: profiling the {machine} {problem}; pricing with the built-in profile", file=sys.stderr)
        return None
    out.unlink()
    log.info("profile of the %s kept in %s", machine, cache.save(machine, profile))
    return profile


def _wait(process, limit: float, check_stop: Callable[[], None]) -> int | None:
    """The child's exit code, or None past the limit; check_stop raises when the user stops us."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        code = process.wait(POLL_EVERY)
        if code is not None:
            return code
        check_stop()
    return None


@dataclass
class Profiles:
    """The profiles a command prices with, and how to get a measured one when a job needs it."""

    book: ProfileBook
    machines: dict[str, Machine] = field(default_factory=dict)  # platform -> this machine's devices
    cache: ProfileCache | None = None  # None: never measure (Ray, CODESIGN_PROFILE=builtin)
    jax_cache: str | None = None
    tried: set[str] = field(default_factory=set)  # platforms measured (or failed) in this command
    learners: dict[str, Learner] = field(default_factory=dict)  # platform -> its calibration (none: not learning)

    def has_measured(self, platform: str) -> bool:
        """No measuring to do for the platform: done, tried, or not allowed here."""
        return self.cache is None or platform not in self.machines or platform in self.tried

    def measured_for(self, platform: str, check_stop: Callable[[], None] = lambda: None) -> ProfileBook:
        """The book, after measuring the platform's devices if they have no measured profile yet."""
        if not self.has_measured(platform):
            self.tried.add(platform)
            profile = measure(self.machines[platform], self.cache, self.jax_cache, check_stop=check_stop)
            if profile is not None:
                self.book.local[platform] = profile.kind
                self.use(platform, profile)
        return self.book

    def use(self, platform: str, base: DeviceProfile) -> None:
        """Price the platform's jobs by this base profile, under its latest calibration where learning."""
        if platform in self.learners:
            self.learners[platform] = Learner.load(self.machines[platform], self.cache, base)
            base = self.learners[platform].profile
        self.book.add(base)


def profiles_for(hosts: Hosts, store: Store | None = None, on_ray: bool = False,
                 cache: ProfileCache | None = None, jax_cache: str | None = None, learning: bool = True) -> Profiles:
    """The profiles at hand for jobs on these hosts: built-in ones, the DB's measured copies of
    other machines' kinds (for simulated clusters), then this machine's cached ones, each under
    its latest accepted calibration (run.learning) unless `learning` is off. On Ray, the jobs'
    nodes are priced by their kind's built-in profile, never by this machine's."""
    book = ProfileBook()
    gpu = builtin_kind(hosts.gpu_kind) or hosts.gpu_kind or "H100"
    book.local.update(gpu=gpu, auto=gpu)
    for profile in store.stored_profiles(DeviceProfile.from_dict) if store is not None else ():
        if profile.source == "measured" and profile.kind not in ("cpu", hosts.gpu_kind):
            book.add(profile)
    if on_ray or os.environ.get("CODESIGN_PROFILE") == "builtin":
        return Profiles(book)
    cache = cache or ProfileCache()
    machines = {"cpu": this_machine("cpu", hosts)}
    if hosts.gpus[0]:
        machines["gpu"] = this_machine("gpu", hosts)
    found = Profiles(book, machines, cache, jax_cache)
    for platform, machine in machines.items():
        profile = cache.load(machine)
        if profile is not None:
            book.local[platform] = profile.kind
            found.tried.add(platform)
        base = profile or book.profiles.get(book.local[platform])
        if learning and learning_enabled() and base is not None:
            found.learners[platform] = Learner(machine, cache, base)
        if base is not None:
            found.use(platform, base)
    return found
