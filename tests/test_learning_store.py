"""The learning store survives crashes (issue 55, item 5): a cached profile is replaced through
a synced temporary file and a synced directory."""

import os

from codesign.config.hosts import Hosts
from codesign.run.profile_cache import this_machine
from tests.test_learning import BASE, cache  # noqa: F401


def synced_and_replaced(monkeypatch) -> list[tuple]:
    """Each os.fsync (the path of the fd it syncs) and os.replace, in order, as they happen."""
    events: list[tuple] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    return events


def test_a_cached_profile_is_replaced_through_a_synced_temporary_file_then_a_synced_directory(cache, monkeypatch):
    machine = this_machine("cpu", Hosts.local(0))
    cache.root.mkdir(parents=True)
    events = synced_and_replaced(monkeypatch)
    path = cache.save(machine, BASE)
    temporary = events[0][1]
    assert events == [("fsync", temporary), ("replace", temporary, str(path)), ("fsync", str(cache.root))]
    assert cache.load(machine) == BASE
