"""The results DB: the only module that speaks SQL.

One row per attempt. The store enforces the attempt state machine: an attempt is
claimed as `running` atomically (two orchestrators never run one job at once), and
only a running attempt can be closed. A running attempt whose orchestrator is gone
(dead pid on this host, or a heartbeat older than STALE_AFTER by the DB's clock; a live
orchestrator's `Heartbeat` thread beats it from claim to close) becomes `interrupted`, which
is not the job's fault: the job runs again without a flag, up to MAX_INTERRUPTED times. What a
finished attempt predicted before it ran is never rewritten: its re-pricings sit beside it, in
table repricings (codesign.store's docstring has the whole contract). The schema version lives
in PRAGMA user_version, and older DBs are brought forward by the ordered migrations of
`schema`, in one transaction. A file that is not a sound SQLite DB is refused before anything
is written to it.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import logging
import os
import socket
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import psutil

from codesign.errors import StoreError
from codesign.outcome import (
    DONE_STATUSES,
    FINAL_STATUSES,
    INTERRUPTED,
    INVALID,
    METRIC_COLUMNS,
    RUNNING,
    SIMULATED,
    Outcome,
)
from codesign.config.types import Job
from codesign.store.schema import (EARLIER_PREDICTIONS, MIGRATIONS, PRICED_BY, REPRICED_COLUMNS, SCHEMA_VERSION,
                                   insert_repricing)

log = logging.getLogger(__name__)
T = TypeVar("T")
BUSY_TIMEOUT = 60.0  # seconds a write waits for another process's lock before it fails
MAX_INTERRUPTED = 3  # interrupted attempts a job is retried for without --retry-failed
CLOCK_SLACK = 1.0  # seconds between a process's start time and the DB clock still counted as "before"
STALE_AFTER = 120.0  # seconds without a heartbeat before another host's attempt counts as dead
NOW = "((julianday('now') - 2440587.5) * 86400.0)"  # the DB clock, in unix seconds
# Errors earlier versions recorded that said nothing about the job itself: such attempts don't
# count, so a plain rerun runs their jobs (codesign 0.1.0 recorded every Auto search job so).
RETIRED_ERRORS = ("Auto search is not supported yet",)
# What an outcome reports beside the metric columns, kept under its name in all_configs.
CONFIG_METRICS = ("losses", "prediction", "auto_search", "auto_trials", "energy", "power", "engine_options")
SQLITE_HEADER = b"SQLite format 3\x00"



@dataclass(frozen=True)
class Decision:
    """What a run would do with a job: "run", "skip" or "running" (elsewhere, now)."""

    action: str
    interrupted: int = 0  # interrupted attempts this run retries

    def __str__(self) -> str:
        if self.action == "run" and self.interrupted:
            return f"retry: interrupted {self.interrupted} of {MAX_INTERRUPTED}"
        return self.action


class Store:
    def __init__(self, path: str | Path, read_only: bool = False, check: bool = False):
        """check: a full `PRAGMA quick_check` even where the file shows no sign of a crash."""
        self.path = str(path)
        self.host = socket.gethostname()
        self.pid = os.getpid()
        try:
            self.conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro" if read_only else self.path,
                                        uri=read_only, isolation_level=None, timeout=BUSY_TIMEOUT)
        except sqlite3.Error as err:
            raise StoreError(f"{self.path}: cannot open results DB: {err}") from None
        try:
            self._check_file(check or _crash_left_files(self.path))
            if not read_only:
                self._use_wal()
            self.conn.row_factory = sqlite3.Row
            self._check_schema(read_only)
        except BaseException:
            self.conn.close()
            raise

    @classmethod
    def open_if_exists(cls, path: str | Path) -> Store | None:
        """Read-only view for a dry run, which must not create or change the DB (an older schema
        is migrated in a private in-memory copy, so that decisions use today's keys)."""
        return cls(path, read_only=True) if Path(path).exists() else None

    def close(self) -> None:
        self.conn.close()

    def _transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """Every write goes through here (or the heartbeat's _immediate)."""
        return _immediate(self.conn)

    def _use_wal(self) -> None:
        """Switch to WAL. The switch takes a lock that SQLite's busy timeout does not wait for, so
        a second orchestrator opening the same fresh DB retries for as long as a write would."""
        deadline = time.monotonic() + BUSY_TIMEOUT
        while True:
            try:
                self.conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _check_file(self, thorough: bool) -> None:
        """Refuse a file that is not a sound SQLite DB before anything writes to it: its header
        and size always, every page (quick_check, seconds on a big DB) only when asked or when a
        crash left a journal beside it."""
        problems = _header_problems(Path(self.path))
        try:
            if not problems:
                self.conn.execute("PRAGMA schema_version").fetchone()
            if not problems and thorough:
                problems = [row[0] for row in self.conn.execute("PRAGMA quick_check")]
                problems = [] if problems == ["ok"] else problems
        except sqlite3.DatabaseError as err:
            problems = [str(err)]
        if problems:
            raise StoreError(f"{self.path}: not a usable SQLite results DB ({problems[0]}); it was "
                             "left untouched: move it aside or pass another --db")

    def _check_schema(self, read_only: bool) -> None:
        """Bring the DB to SCHEMA_VERSION in one immediate transaction: the version is read again
        under the write lock, so orchestrators opening a fresh DB at once migrate it exactly once.
        Read only (a dry run), an older schema is migrated in a private in-memory copy."""
        if self._version() == SCHEMA_VERSION:
            return
        if read_only:
            self.conn = _in_memory_copy(self.conn)
        with self._transaction() as conn:
            version = self._version()
            for migrate in MIGRATIONS[version:]:
                migrate(conn)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _version(self) -> int:
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path}: schema version {version} is newer than this codesign "
                             f"understands ({SCHEMA_VERSION}); upgrade codesign")
        return version

    @property
    def schema_version(self) -> int:
        return self.conn.execute("PRAGMA user_version").fetchone()[0]

    # -- decisions -------------------------------------------------------------------------

    def decide(self, key: str, retry_failed: bool) -> Decision:
        """Run, skip (finished, or attempted and not retry_failed) or running elsewhere.

        Interrupted attempts are not the job's fault: up to MAX_INTERRUPTED of them, and nothing
        else finished, the job runs again without a flag; past that it counts as failed. Invalid
        attempts with a RETIRED_ERRORS error are not attempts at all.
        """
        retired = ", ".join("?" for _ in RETIRED_ERRORS)
        counts = collections.Counter(row[0] for row in self.conn.execute(
            f"SELECT status FROM attempts WHERE job_key = ? AND NOT (status = ? AND error IN ({retired}))",
            (key, INVALID, *RETIRED_ERRORS)))
        if counts.get(RUNNING):
            return Decision("running")
        if any(counts.get(status) for status in DONE_STATUSES):
            return Decision("skip")
        interrupted = counts.get(INTERRUPTED, 0)
        if sum(counts.values()) == interrupted and interrupted < MAX_INTERRUPTED:
            return Decision("run", interrupted)
        return Decision("run" if retry_failed else "skip")

    # -- the attempt state machine ---------------------------------------------------------

    def reap_stale(self) -> int:
        """Mark running attempts whose orchestrator is gone as interrupted; returns how many."""
        with self._transaction() as conn:
            return self._reap(conn, None)

    def _reap(self, conn: sqlite3.Connection, key: str | None) -> int:
        rows = conn.execute(
            f"SELECT id, host, pid, started_at, {NOW} - heartbeat AS silent FROM attempts WHERE status = ?"
            + (" AND job_key = ?" if key else ""), (RUNNING, key) if key else (RUNNING,)).fetchall()
        dead = [r["id"] for r in rows
                if (r["silent"] if r["silent"] is not None else float("inf")) > STALE_AFTER
                or (r["host"] == self.host and not _alive(r["pid"], r["started_at"]))]
        for attempt_id in dead:
            conn.execute(f"UPDATE attempts SET status = ?, finished_at = {NOW}, error = ? WHERE id = ?",
                         (INTERRUPTED, "orchestrator stopped while the job ran", attempt_id))
        return len(dead)

    def claim(self, key: str, job: Job, retry_failed: bool) -> int | None:
        """Atomically open a running attempt for the job, or None when it must not run now."""
        with self._transaction() as conn:
            self._reap(conn, key)
            if self.decide(key, retry_failed).action != "run":
                return None
            row = {**_spec_columns(job), "job_key": key, "status": RUNNING,
                   "datetime": datetime.datetime.now().isoformat(timespec="seconds"),
                   "trail_uuid": str(uuid.uuid4()), "platform": job.platform,
                   "host": self.host, "pid": self.pid}
            names = ", ".join(row)
            marks = ", ".join("?" for _ in row)
            cur = conn.execute(f"INSERT INTO attempts ({names}, started_at, heartbeat) "
                               f"VALUES ({marks}, {NOW}, {NOW})", tuple(row.values()))
            return cur.lastrowid

    def finish(self, attempt_id: int, outcome: Outcome, columns: dict[str, Any] | None = None) -> bool:
        """Close a running attempt; False when it was no longer running (reaped meanwhile).
        columns: spec columns to overwrite (an Auto search job's chosen plan, as a manual spec's)."""
        if outcome.status not in FINAL_STATUSES:
            raise ValueError(f"not a final status: {outcome.status}")
        unknown = set(outcome.metrics) - set(METRIC_COLUMNS) - set(CONFIG_METRICS)
        if unknown:
            raise ValueError(f"metrics with no column: {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {k: _cell(outcome.metrics.get(k)) for k in METRIC_COLUMNS}
        values.update(status=outcome.status, error=outcome.error or None, job_duration=outcome.duration)
        values.update({k: _cell(v) for k, v in (columns or {}).items()})
        with self._transaction() as conn:
            row = conn.execute("SELECT all_configs FROM attempts WHERE id = ?", (attempt_id,)).fetchone()
            extra = {k: v for k, v in (("plan", outcome.plan), ("chosen_plan", outcome.chosen_plan),
                                       *((k, outcome.metrics.get(k)) for k in CONFIG_METRICS)) if v}
            if extra and row:
                values["all_configs"] = json.dumps({**json.loads(row["all_configs"]), **extra})
            sets = ", ".join(f"{k} = ?" for k in values)
            cur = conn.execute(f"UPDATE attempts SET {sets}, finished_at = {NOW}, heartbeat = {NOW} "
                               f"WHERE id = ? AND status = ?", (*values.values(), attempt_id, RUNNING))
            return cur.rowcount == 1

    def reprice(self, attempt_id: int, prediction: dict[str, Any], in_sample: bool) -> None:
        """A finished attempt priced again, beside what it predicted before it ran (never rewritten):
        one more of its repricings, with what priced it and whether that calibration was fitted
        to the attempt itself. A simulated attempt, whose prediction is its result, is
        reprice_simulated's."""
        repriced = {**{k: _cell(prediction.get(k)) for k in PRICED_BY}, "prediction": prediction.get("prediction")}
        with self._transaction() as conn:
            row = conn.execute("SELECT status FROM attempts WHERE id = ?", (attempt_id,)).fetchone()
            if row is None or row["status"] in (RUNNING, SIMULATED):
                raise ValueError(f"attempt {attempt_id} is running, simulated or absent: not re-priced beside")
            insert_repricing(conn, attempt_id, repriced, in_sample, NOW)

    def reprice_simulated(self, attempt_id: int, prediction: dict[str, Any]) -> None:
        """A simulated attempt's prediction (nothing ran: it is its result) from the cost model as
        it is now; the one it replaces, where it differs, joins its EARLIER_PREDICTIONS."""
        values = {k: _cell(prediction.get(k)) for k in PRICED_BY}
        with self._transaction() as conn:
            row = conn.execute(f"SELECT all_configs, {', '.join(PRICED_BY)} FROM attempts WHERE id = ? AND status = ?",
                               (attempt_id, SIMULATED)).fetchone()
            if row is None:
                raise ValueError(f"attempt {attempt_id} is not simulated: what it predicted before it ran is kept")
            configs = json.loads(row["all_configs"] or "{}")
            before = {**{k: row[k] for k in PRICED_BY}, "prediction": configs.get("prediction")}
            now = json.loads(json.dumps({**values, "prediction": prediction.get("prediction")}))
            if before != now and any(v is not None for v in before.values()):
                configs[EARLIER_PREDICTIONS] = [*configs.get(EARLIER_PREDICTIONS, []), before]
            configs["prediction"] = now["prediction"]
            sets = ", ".join(f"{k} = ?" for k in values)
            conn.execute(f"UPDATE attempts SET {sets}, all_configs = ? WHERE id = ?",
                         (*values.values(), json.dumps(configs), attempt_id))

    # -- reading ---------------------------------------------------------------------------

    def attempts(self, statuses: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Every attempt (or those in the given statuses), oldest first, as column -> value."""
        if statuses is None:
            rows = self.conn.execute("SELECT * FROM attempts ORDER BY id")
        else:
            wanted = tuple(statuses)
            marks = ", ".join("?" for _ in wanted)
            rows = self.conn.execute(f"SELECT * FROM attempts WHERE status IN ({marks}) ORDER BY id", wanted)
        return [dict(r) for r in rows]

    def attempts_repriced(self, statuses: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """As attempts(), each with its latest repricing beside its own columns (REPRICED_COLUMNS,
        None where it was never re-priced)."""
        wanted = () if statuses is None else tuple(statuses)
        where = "" if statuses is None else f"WHERE a.status IN ({', '.join('?' for _ in wanted)}) "
        repriced = ", ".join(f"r.{column} AS {name}" for name, column in REPRICED_COLUMNS.items())
        rows = self.conn.execute(
            f"SELECT a.*, {repriced} FROM attempts a LEFT JOIN repricings r ON r.id = "
            f"(SELECT max(id) FROM repricings WHERE attempt_id = a.id) {where}ORDER BY a.id", wanted)
        return [dict(r) for r in rows]

    def attempts_of(self, key: str, status: str) -> list[dict[str, Any]]:
        """A job's attempts in one status, oldest first."""
        rows = self.conn.execute("SELECT * FROM attempts WHERE job_key = ? AND status = ? ORDER BY id", (key, status))
        return [dict(r) for r in rows]

    def attempt_columns(self) -> list[str]:
        return [r[1] for r in self.conn.execute("PRAGMA table_info(attempts)")]

    # -- device profiles -------------------------------------------------------------------

    def keep_profile(self, profile_id: str, profile: dict[str, Any]) -> None:
        """Keep a copy of a profile that priced attempts here, under its id (once)."""
        with self._transaction() as conn:
            conn.execute(f"INSERT OR IGNORE INTO profiles (profile_id, device_kind, platform, source, versions, "
                         f"profile, host, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, {NOW})",
                         (profile_id, profile["kind"], profile["platform"], profile.get("source"),
                          _versions(profile.get("versions", {})), json.dumps(profile), self.host))

    def stored_profiles(self, read: Callable[[dict[str, Any]], T] = lambda data: data) -> list[T]:
        """Every profile kept here, oldest first, as `read` makes it of its JSON. A row that does
        not read (damaged, or edited by hand) is skipped with a warning naming it: one bad copy
        must not stop every command on this DB."""
        found = []
        rows = self.conn.execute("SELECT profile_id, profile FROM profiles ORDER BY created_at, rowid")
        for profile_id, text in rows:
            try:
                found.append(read(json.loads(text)))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                log.warning("%s: table profiles, profile_id %r: unreadable profile skipped (%s: %s)",
                            self.path, profile_id, type(err).__name__, err)
        return found


class Heartbeat:
    """Beats the attempts this orchestrator holds, every `every` seconds, from a thread and a
    connection of its own, from claim to close: the sweep's thread may be busy for minutes (Auto
    search pricing a large space) while other hosts reap attempts silent for STALE_AFTER."""

    def __init__(self, path: str, every: float):
        self.path, self.every = path, every
        self._held: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, attempt_id: int) -> None:
        with self._lock:
            self._held.add(attempt_id)

    def release(self, attempt_id: int) -> None:
        with self._lock:
            self._held.discard(attempt_id)

    def __enter__(self) -> Heartbeat:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="codesign-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT)
        try:
            while not self._stop.wait(self.every):
                with self._lock:
                    held = tuple(self._held)
                try:
                    if held:
                        _beat(conn, held)
                except sqlite3.Error as err:  # the next beat may pass; the sweep goes on meanwhile
                    log.warning("%s: heartbeat of attempt(s) %s failed: %s", self.path, list(held), err)
        finally:
            conn.close()


def _beat(conn: sqlite3.Connection, attempt_ids: tuple[int, ...]) -> None:
    """The attempts still running are alive now, by the DB's clock."""
    marks = ", ".join("?" for _ in attempt_ids)
    with _immediate(conn):
        conn.execute(f"UPDATE attempts SET heartbeat = {NOW} WHERE status = ? AND id IN ({marks})",
                     (RUNNING, *attempt_ids))


@contextlib.contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A write transaction: BEGIN IMMEDIATE serialises orchestrators."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _versions(versions: dict[str, str]) -> str:
    return json.dumps(versions, sort_keys=True)


def _header_problems(path: Path) -> list[str]:
    """What the first 100 bytes say is wrong with the file: not SQLite, or shorter than the page
    count its header records (a truncated copy). An empty or missing file is a new DB."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(100)
    except OSError:
        return []
    if size == 0:
        return []
    if len(header) < 100 or not header.startswith(SQLITE_HEADER):
        return ["file is not a database"]
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    counted = header[24:28] == header[92:96]  # the header's page count is valid
    if counted and size < page_size * pages:
        return [f"truncated: {size} bytes of the {page_size * pages} its header records"]
    return []


def _crash_left_files(path: str) -> bool:
    """A rollback journal or a WAL beside the DB: a process crashed, or another one has it open."""
    return any(os.path.exists(path + suffix) for suffix in ("-journal", "-wal"))


def _in_memory_copy(conn: sqlite3.Connection) -> sqlite3.Connection:
    copy = sqlite3.connect(":memory:", isolation_level=None)
    conn.backup(copy)
    conn.close()
    copy.row_factory = sqlite3.Row
    return copy


def _alive(pid: int | None, claimed_at: float | None) -> bool:
    """The process that claimed an attempt still runs: its pid exists, is no zombie, and was not
    reused by a process started after the claim (pids cycle within seconds on a busy machine)."""
    if pid is None:
        return False
    try:
        process = psutil.Process(pid)
        return (process.status() != psutil.STATUS_ZOMBIE
                and process.create_time() <= (claimed_at or float("inf")) + CLOCK_SLACK)
    except psutil.NoSuchProcess:
        return False


def _cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (dict, list, tuple)) else value


def _spec_columns(job: Job) -> dict[str, Any]:
    """The earlier toolkit's columns, filled from the job's specs."""
    m, c, t, p = job.model, job.cluster, job.training, job.parallel
    return {
        **m.result_columns(),
        "num_nodes": c.num_hosts, "gpus_per_node": c.num_devices_per_host, "transport": c.transport,
        "input_batch_size": job.global_batch, "avg_batch_size_per_gpu": job.global_batch // c.num_devices,
        "num_iters": t.num_iters, "description": p.description,
        "num_micro_batches": job.num_micro_batches, "num_auto_layers": p.num_auto_layers,
        "pp_dp_op": _cell(p.pp_dp_op), "physical_mesh_shapes": _cell(p.physical_mesh_shape),
        "host_ids": _cell(p.host_ids), "device_ids": _cell(p.device_ids),
        "remat_layer": int(p.remat_layer), "precision": t.precision,
        "all_configs": json.dumps(job.to_dict()),
    }
