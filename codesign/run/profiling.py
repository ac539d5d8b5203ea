"""Device profiles for a sweep: measured once per device kind and library versions, kept in the DB.

Measuring runs `python -m codesign.engine.profile` in a child (JAX never enters the
orchestrator), with 8 virtual devices on CPU so the shared-core speed-up is measured too.
CODESIGN_PROFILE=builtin skips measuring and prices with the built-in profiles (tests do).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable

from codesign.errors import UserError
from codesign.planner.profiles import DeviceProfile, ProfileBook, library_versions
from codesign.spec.hosts import device_env, local_gpu_kind
from codesign.spec.jobs import PlannedJob
from codesign.store.database import Store

log = logging.getLogger(__name__)
CPU_PROFILE_DEVICES = 8
PROFILE_TIMEOUT = 600


def measure(platform: str) -> DeviceProfile:
    """Profile this machine's devices of a platform in a child process; its progress goes to stderr."""
    env = device_env(dict(os.environ, PYTHONUNBUFFERED="1"), platform, CPU_PROFILE_DEVICES)
    with tempfile.TemporaryDirectory(prefix="codesign-profile-") as tmp:
        out = Path(tmp) / "profile.json"
        proc = subprocess.run([sys.executable, "-m", "codesign.engine.profile", str(out)], env=env,
                              timeout=PROFILE_TIMEOUT, stdout=subprocess.DEVNULL)
        if proc.returncode != 0 or not out.exists():
            raise UserError(f"profiling the {platform} devices failed (exit code {proc.returncode})")
        return DeviceProfile.from_dict(json.loads(out.read_text()))


def local_kind(platform: str) -> str:
    return local_gpu_kind() if platform == "gpu" else "cpu"


def load_book(store: Store | None) -> ProfileBook:
    """Built-in profiles overlaid with the DB's: for each kind, the one measured under the
    installed library versions, else the most recent one."""
    book = ProfileBook()
    if store is None:
        return book
    versions = library_versions()
    for kind, data in store.latest_profiles().items():
        book.add(DeviceProfile.from_dict(store.profile(kind, versions) or data))
    return book


def ensure_profiles(store: Store, planned: Iterable[PlannedJob]) -> ProfileBook:
    """Before the first job: measure each local platform the sweep will run on, unless the DB
    holds a profile of its device kind under the installed library versions."""
    book = load_book(store)
    platforms = sorted({p.job.platform for p in planned if not p.unavailable and p.job.platform != "sim"})
    versions = library_versions()
    for platform in platforms:
        kind = local_kind(platform)
        book.local[platform] = kind
        if store.profile(kind, versions) is not None or os.environ.get("CODESIGN_PROFILE") == "builtin":
            continue
        print(f"codesign: profiling the {platform} devices ({kind}) once for the cost model...", file=sys.stderr)
        profile = measure(platform)
        store.save_profile(profile.kind, versions, platform, profile.to_dict())
        book.add(profile)
        book.local[platform] = profile.kind
    return book
