"""The attempts table and its history: each migration brings a DB one schema version forward.

A migration is a list of SQL statements run in order inside the store's opening transaction
(never a script split on ";"). The version reached is kept in PRAGMA user_version.
"""

from __future__ import annotations

import json
import re
import sqlite3
from typing import Any, Callable

from codesign.config.jobs import job_key
from codesign.config.types import Job

Migration = Callable[[sqlite3.Connection], None]

LEGACY_COLUMNS = (
    "datetime", "job_duration", "trail_uuid", "num_zhen_layers", "token_mixer", "input_features",
    "emb_dimensions", "output_per_ensemble", "num_nodes", "gpus_per_node", "transport",
    "input_batch_size", "avg_batch_size_per_gpu", "num_iters", "description", "num_micro_batches",
    "num_auto_layers", "pp_dp_op", "physical_mesh_shapes", "host_ids", "device_ids", "remat_layer",
    "avg", "median", "p90", "max_memory", "error", "all_configs")

V1_STATUSES = ("running", "succeeded", "failed", "timeout", "oom", "invalid", "interrupted")
_STATUSES = ", ".join(f"'{s}'" for s in V1_STATUSES)

V1_ATTEMPTS = [f"""
CREATE TABLE attempts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_key TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ({_STATUSES})),
    datetime TEXT, job_duration REAL, trail_uuid TEXT,
    num_zhen_layers INTEGER, token_mixer TEXT, input_features INTEGER, emb_dimensions INTEGER,
    output_per_ensemble INTEGER, num_nodes INTEGER, gpus_per_node INTEGER, transport TEXT,
    input_batch_size INTEGER, avg_batch_size_per_gpu INTEGER, num_iters INTEGER,
    description TEXT, num_micro_batches INTEGER, num_auto_layers INTEGER, pp_dp_op TEXT,
    physical_mesh_shapes TEXT, host_ids TEXT, device_ids TEXT, remat_layer INTEGER,
    avg REAL, median REAL, p90 REAL, max_memory INTEGER, error TEXT, all_configs TEXT,
    throughput REAL, compile_time REAL, predicted_time REAL, predicted_memory INTEGER,
    platform TEXT, device_kind TEXT, versions TEXT,
    host TEXT, pid INTEGER, started_at REAL, heartbeat REAL, finished_at REAL
)""", "CREATE INDEX attempts_by_key ON attempts (job_key, status)"]

V2_PRECISION_ENERGY = [  # older rows ran fp32
    "ALTER TABLE attempts ADD COLUMN precision TEXT",
    "ALTER TABLE attempts ADD COLUMN energy_per_iter REAL",
    "UPDATE attempts SET precision = 'fp32'",
]


# The earlier toolkit's table, as users query it (`select * from results where avg is not null`):
# its columns, one row per finished attempt. A migration that rebuilds `attempts` drops this view
# first (SQLite refuses to rename a table a view reads) and runs RESULTS_VIEW again after.
RESULTS_VIEW = [
    "DROP VIEW IF EXISTS results",
    f"CREATE VIEW results AS SELECT {', '.join(LEGACY_COLUMNS)} FROM attempts "
    "WHERE status <> 'running' ORDER BY id",
]


def rekey(conn: sqlite3.Connection) -> None:
    """Key version 2: every attempt's key recomputed from the job it recorded (all_configs), so
    a DB written before the canonical form changed keeps its skips."""
    for attempt_id, configs in conn.execute("SELECT id, all_configs FROM attempts").fetchall():
        if configs:
            key = job_key(Job.from_dict(json.loads(configs)))
            conn.execute("UPDATE attempts SET job_key = ? WHERE id = ?", (key, attempt_id))


def _statements(statements: list[str]) -> Migration:
    def run(conn: sqlite3.Connection) -> None:
        for statement in statements:
            conn.execute(statement)
    return run


PROFILES = ["""
CREATE TABLE profiles (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    device_kind TEXT NOT NULL,
    versions TEXT NOT NULL,
    platform TEXT NOT NULL,
    profile TEXT NOT NULL,
    host TEXT,
    created_at REAL,
    UNIQUE (device_kind, versions)
)"""]


V6_STATUSES = (*V1_STATUSES, "simulated")


def allow_simulated(conn: sqlite3.Connection) -> None:
    """Rebuild attempts with 'simulated' among the statuses its CHECK allows (SQLite cannot alter
    a CHECK) and a compiled_memory column (XLA's analysis; predicted_memory is the cost model's).
    Older rows' predicted_memory was XLA's analysis: it moves to compiled_memory.
    The table is rebuilt from its current definition, whatever columns earlier migrations added;
    its indexes, triggers and the views over it are dropped and re-created around the swap."""
    table = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'attempts'").fetchone()[0]
    dependents = conn.execute(
        "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL AND name != 'attempts' AND "
        "(tbl_name = 'attempts' OR (type = 'view' AND sql LIKE '%attempts%')) ORDER BY type = 'view'").fetchall()
    for kind, name, _ in reversed(dependents):
        conn.execute(f'DROP {kind.upper()} IF EXISTS "{name}"')
    statuses = ", ".join(f"'{s}'" for s in V6_STATUSES)
    rebuilt, found = re.subn(r"CHECK\s*\(\s*status\s+IN\s*\([^)]*\)\s*\)", f"CHECK (status IN ({statuses}))", table)
    if found != 1:
        raise sqlite3.DatabaseError("attempts has no CHECK (status IN (...)) to extend")
    columns = ", ".join(f'"{r[1]}"' for r in conn.execute("PRAGMA table_info(attempts)"))
    conn.execute(re.sub(r"^\s*CREATE TABLE\s+\"?attempts\"?", "CREATE TABLE attempts_rebuilt", rebuilt))
    conn.execute(f"INSERT INTO attempts_rebuilt ({columns}) SELECT {columns} FROM attempts")
    conn.execute("DROP TABLE attempts")
    conn.execute("ALTER TABLE attempts_rebuilt RENAME TO attempts")
    conn.execute("ALTER TABLE attempts ADD COLUMN compiled_memory INTEGER")
    conn.execute("UPDATE attempts SET compiled_memory = predicted_memory, predicted_memory = NULL")
    for _, _, sql in dependents:
        conn.execute(sql)


# v7: profiles kept per machine in the user's cache; the DB keeps a copy of each one that priced
# an attempt, under its id (measured copies of v5 under "legacy-N"), and every attempt says
# what priced it, what recorded it, where it ran and where its log is.
V7_PROVENANCE = [
    """CREATE TABLE profiles_v7 (
    profile_id TEXT PRIMARY KEY,
    device_kind TEXT NOT NULL,
    platform TEXT NOT NULL,
    source TEXT,
    versions TEXT,
    profile TEXT NOT NULL,
    host TEXT,
    created_at REAL
)""",
    "INSERT INTO profiles_v7 SELECT 'legacy-' || id, device_kind, platform, 'measured', versions, profile, host, "
    "created_at FROM profiles",
    "DROP TABLE profiles",
    "ALTER TABLE profiles_v7 RENAME TO profiles",
    "ALTER TABLE attempts ADD COLUMN profile_id TEXT",
    "ALTER TABLE attempts ADD COLUMN cost_model TEXT",
    "ALTER TABLE attempts ADD COLUMN codesign_version TEXT",
    "ALTER TABLE attempts ADD COLUMN gpu_ids TEXT",
    "ALTER TABLE attempts ADD COLUMN jobs_beside INTEGER",
    "ALTER TABLE attempts ADD COLUMN log_path TEXT",
]


# v8: energy as the job measured it (average watts per device, which counter) and as the cost
# model predicted it, beside energy_per_iter.
V8_ENERGY = [
    "ALTER TABLE attempts ADD COLUMN avg_power REAL",
    "ALTER TABLE attempts ADD COLUMN energy_source TEXT",
    "ALTER TABLE attempts ADD COLUMN predicted_energy REAL",
]


# An attempt's prediction and what priced it: what it predicted before it ran (never rewritten,
# save a simulated attempt's, whose prediction is its result), as each re-pricing records it too.
PRICED_BY = ("predicted_time", "predicted_memory", "predicted_energy", "profile_id", "cost_model")
# all_configs' list of the predictions a simulated attempt's re-pricings replaced, oldest first
EARLIER_PREDICTIONS = "earlier_predictions"

# v9: each re-pricing of a finished attempt, beside the prediction it made before it ran: what
# priced it (profile, cost model, calibration version, NULL for none), when by the DB's clock,
# and whether that calibration was fitted to the attempt itself (in_sample: hindsight, not a forecast).
REPRICINGS = ["""
CREATE TABLE repricings (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    attempt_id INTEGER NOT NULL REFERENCES attempts (id),
    repriced_at REAL,
    predicted_time REAL, predicted_memory INTEGER, predicted_energy REAL,
    profile_id TEXT, cost_model TEXT, calibration INTEGER,
    in_sample INTEGER NOT NULL CHECK (in_sample IN (0, 1)),
    prediction TEXT
)""", "CREATE INDEX repricings_by_attempt ON repricings (attempt_id)"]
# A repricing's columns as an export shows the latest one beside its attempt's, after them.
REPRICED_COLUMNS = {"repriced_time": "predicted_time", "repriced_memory": "predicted_memory",
                    "repriced_energy": "predicted_energy", "repriced_profile_id": "profile_id",
                    "repriced_cost_model": "cost_model", "repriced_calibration": "calibration",
                    "repriced_in_sample": "in_sample", "repriced_at": "repriced_at"}


def keep_before_it_ran(conn: sqlite3.Connection) -> None:
    """Re-pricings beside the predictions they re-price. A measured attempt that an earlier
    codesign re-priced in place gets back the prediction it made before it ran (the oldest of its
    EARLIER_PREDICTIONS); the later ones, and what its columns held, become its re-pricings, of
    unknown date, in-sample wherever a calibration made them (what it was fitted to is unknown)."""
    for statement in REPRICINGS:
        conn.execute(statement)
    rows = conn.execute(f"SELECT id, all_configs, {', '.join(PRICED_BY)} FROM attempts WHERE status NOT IN "
                        f"('running', 'simulated') AND all_configs LIKE '%{EARLIER_PREDICTIONS}%'").fetchall()
    for attempt_id, text, *priced in rows:
        configs = json.loads(text)
        if EARLIER_PREDICTIONS not in configs:
            continue
        original, *later = configs.pop(EARLIER_PREDICTIONS)
        for repriced in [*later, {**dict(zip(PRICED_BY, priced)), "prediction": configs.pop("prediction", None)}]:
            insert_repricing(conn, attempt_id, repriced, (repriced["prediction"] or {}).get("calibration") is not None)
        if original.get("prediction") is not None:
            configs["prediction"] = original["prediction"]
        conn.execute(f"UPDATE attempts SET {', '.join(f'{k} = ?' for k in PRICED_BY)}, all_configs = ? WHERE id = ?",
                     (*(original.get(k) for k in PRICED_BY), json.dumps(configs), attempt_id))


def insert_repricing(conn: sqlite3.Connection, attempt_id: int, repriced: dict[str, Any], in_sample: bool,
                     at: str = "NULL") -> None:
    """One re-pricing of an attempt: `repriced` holds PRICED_BY's values and the breakdown under
    "prediction"; `at` is the SQL of its time (NULL: unknown)."""
    calibration = (repriced.get("prediction") or {}).get("calibration")
    conn.execute(f"INSERT INTO repricings (attempt_id, repriced_at, {', '.join(PRICED_BY)}, calibration, in_sample, "
                 f"prediction) VALUES (?, {at}, {', '.join('?' for _ in PRICED_BY)}, ?, ?, ?)",
                 (attempt_id, *(repriced.get(k) for k in PRICED_BY), calibration, in_sample,
                  json.dumps(repriced.get("prediction"))))


MIGRATIONS: list[Migration] = [
    _statements(V1_ATTEMPTS),
    _statements(V2_PRECISION_ENERGY),
    rekey,  # v3: job keys leave optional fields at their defaults out
    _statements(RESULTS_VIEW),  # v4: the earlier toolkit's `results`, as a view
    _statements(PROFILES),  # v5: device profiles for the cost model
    allow_simulated,  # v6: 'simulated' attempts, compiled_memory apart from predicted_memory
    _statements(V7_PROVENANCE),  # v7: profile copies by id; what priced, recorded and ran each attempt
    _statements(V8_ENERGY),  # v8: avg_power, energy_source, predicted_energy
    keep_before_it_ran,  # v9: repricings beside the predictions made before the attempts ran
]
SCHEMA_VERSION = len(MIGRATIONS)
