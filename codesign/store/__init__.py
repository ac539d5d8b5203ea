"""The results DB (the only place SQL lives), its schema and migrations, and the CSV exports.

The store's contract, which `database.Store` enforces and every writer keeps:

Who owns an attempt. An attempt is claimed as `running` in one write transaction that reaps the
job's stale attempts, decides and inserts, so two orchestrators never run one job at once. The
orchestrator that claimed it owns it: only it closes it (`finish` changes a running attempt and
nothing else), and its `Heartbeat` thread beats it from claim to close. Any other process may
reap it, as `interrupted`, once its owner is gone: its pid dead on this host, or its heartbeat
older than STALE_AFTER by the DB's clock. An owner whose attempt was reaped meanwhile is told so
(`finish` returns False) and its outcome is dropped. Job processes never write the DB; on a Ray
cluster only the orchestrator does.

What is immutable. A finished attempt (any status but `running`) is never changed: neither what
it measured nor what it predicted before it ran (`predicted_time`, `predicted_memory`,
`predicted_energy`, the `profile_id` and `cost_model` that made them, `all_configs`'
`prediction`), which is what tells how well the cost model forecasts. Pricing it again
(`Store.reprice`, from `codesign reprice`) adds a row to `repricings` beside it, with what
priced it and whether that calibration was fitted to the attempt (`in_sample`). The one
exception is a `simulated` attempt: nothing ran, its prediction is its result, and
`Store.reprice_simulated` replaces it (a sweep does when its profile, links or cost model
changed), keeping the one it replaces in `all_configs`' `earlier_predictions`. Copies of
profiles (`profiles`) are written once per id and never changed. Only a migration rewrites
rows, to bring an older DB to today's schema (re-keyed jobs, XLA's memory moved to
`compiled_memory`, predictions that earlier re-pricings overwrote put back).

Who writes what. A sweep: its own attempts (claim, heartbeat, finish), the reaping of stale
ones, its simulated attempts' predictions, the profiles that priced them. `codesign reprice`:
`repricings`, simulated attempts' predictions, profile copies. Opening a DB at an older schema
version (PRAGMA user_version): its migrations. Reports, exports and dry runs only read (opened
read-only, an older DB is migrated in a private in-memory copy).

What survives a crash. The DB is in WAL mode with SQLite's default synchronous=FULL, and every
write is one BEGIN IMMEDIATE transaction committed before the call returns: a crash of the
process or the machine loses at most the transaction in flight, never part of one. A claim is
committed before its job starts, so an orchestrator killed mid-job leaves a `running` attempt
that the next run reaps as `interrupted` and retries (up to MAX_INTERRUPTED times); a job's
measurements exist once `finish` commits. A migration runs in one transaction: a crash leaves
the DB at its old version. A file that is not a sound SQLite DB is refused before anything is
written to it. WAL needs the DB on a local disk, not a network file system.
"""
