"""Re-price recorded attempts with the profiles and cost model at hand now: after `codesign
profile` measured this machine, or after a release changed the cost model. Each attempt keeps
the links it recorded (a config's [links] are the user's, not the machine's).

What an attempt predicted before it ran is never rewritten: a measured attempt's new prediction
is one more of its repricings, beside it, saying whether the calibration that made it was
fitted to the attempt (in-sample: hindsight, not a forecast). A simulated attempt ran nothing:
its prediction is its result, and is replaced (the store keeps the one it replaces)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from codesign.config.jobs import job_key
from codesign.cost.learning import Point
from codesign.outcome import RUNNING, SIMULATED, SUCCEEDED
from codesign.run.learning import Learner
from codesign.cost.model import COST_MODEL_VERSION, Workload, estimate, predict, recorded
from codesign.cost.plan import Plan
from codesign.hardware.profiles import DeviceProfile, ProfileBook, profile_id
from codesign.config.loader import LinkSpec
from codesign.config.types import Job
from codesign.store.database import Store


def with_provenance(found: dict[str, Any], profile: DeviceProfile, links: Iterable[LinkSpec]) -> dict[str, Any]:
    """A prediction as an attempt records it: which profile, links, calibration (its version,
    None uncalibrated) and cost model made it (a simulated attempt is re-priced when they change)."""
    return {**found, "prediction": {**found["prediction"], "links": [dataclasses.asdict(link) for link in links],
                                    "calibration": profile.calibration.version or None},
            "profile_id": profile_id(profile), "cost_model": COST_MODEL_VERSION}


def stale(row: dict[str, Any], now: dict[str, Any]) -> bool:
    """The attempt was priced by another profile, other links or another cost model than now."""
    then = json.loads(row["all_configs"] or "{}").get("prediction") or {}
    return (row["profile_id"], row["cost_model"], then.get("links", [])) != \
        (now["profile_id"], now["cost_model"], now["prediction"]["links"])


def prediction(row: dict[str, Any], book: ProfileBook,
               links: Iterable[LinkSpec] = ()) -> tuple[dict[str, Any], DeviceProfile | None]:
    """An attempt's prediction now, and the profile that made it: of the plan the toolkit chose
    for it, else of its manual spec's; ({}, None) where it has no plan to price (an invalid spec,
    Auto search that chose none)."""
    configs = json.loads(row["all_configs"] or "{}")
    if not configs:
        return {}, None
    job = Job.from_dict(configs)
    book = as_of_device(book, job, row["device_kind"])
    profile = book.for_job(job)
    if configs.get("chosen_plan"):
        found = recorded(estimate(Workload.of(job, profile, links), Plan.from_dict(configs["chosen_plan"])), profile)
    else:
        found = predict(job, book, links)
    if not found:
        return {}, None
    return with_provenance(found, profile, links), profile


def as_of_device(book: ProfileBook, job: Job, kind: str | None) -> ProfileBook:
    """The book pricing a job as of the device kind its attempt ran on, where the book holds a
    measured profile of that kind (the DB keeps a copy of each): a GPU DB re-priced on a laptop
    is priced by its GPUs' profile, not the laptop's idea of a GPU (the built-in H100)."""
    if job.cluster.is_simulated or not kind or kind not in book.profiles:
        return book
    return dataclasses.replace(book, local={**book.local, job.platform: kind})


def recorded_links(row: dict[str, Any]) -> tuple[LinkSpec, ...] | None:
    """The links an attempt was priced with, as it recorded them; None where it recorded none
    (attempts priced before predictions recorded their links)."""
    then = json.loads(row["all_configs"] or "{}").get("prediction") or {}
    return tuple(LinkSpec(**link) for link in then["links"]) if "links" in then else None


Measurement = tuple[str, str, float | None, float | None]  # job key, status, median, peak


@dataclass(frozen=True)
class Fitted:
    """What a calibration in use on this machine was fitted to: when, and the measurements of
    the machine's points (pooled over its DBs, so a DB's attempts are found wherever it was moved)."""

    created: float
    measured: frozenset[Measurement]


def fitted_calibrations(learners: Iterable[Learner]) -> dict[str, Fitted]:
    """The profile id each machine prices by, where a calibration is in use -> what it was fitted to."""
    return {profile_id(learner.profile): Fitted(learner.current.created, frozenset(map(point_measurement,
                                                                                        learner.points())))
            for learner in learners if learner.current is not None}


def point_measurement(point: Point) -> Measurement:
    return job_key(point.job), point.status, point.seconds, _bytes(point.peak)


def attempt_measurement(row: dict[str, Any]) -> Measurement:
    """What the attempt's point measured, had it been one (run.learning.point_of)."""
    return row["job_key"], row["status"], row["median"] if row["status"] == SUCCEEDED else None, _bytes(row["max_memory"])


def _bytes(peak: float | None) -> float | None:
    return None if peak is None else float(peak)


def in_sample(row: dict[str, Any], profile: DeviceProfile, fitted: Mapping[str, Fitted]) -> bool:
    """Whether the calibration that priced the attempt again may have been fitted to it. No
    calibration (the base profile) was fitted to no attempt. This machine's calibration in use
    was, when the attempt's measurement is one of the machine's points and the attempt finished
    before the calibration was fitted. Any other (another machine's, in the DB's copy of the
    profile that priced it there) is counted in-sample: what it was fitted to is not at hand.
    (A point is pooled after its attempt is finished, and a calibration stamped after it read its
    points: one that saw the attempt was created after it finished, by this host's clock.)"""
    if not profile.calibration.version:
        return False
    fit = fitted.get(profile_id(profile))
    if fit is None:
        return True
    finished = row["finished_at"] if row["finished_at"] is not None else float("inf")
    return attempt_measurement(row) in fit.measured and finished <= fit.created


@dataclass
class Repriced:
    """What a reprice did: simulated attempts' predictions replaced, measured attempts' repricings
    kept beside the predictions they made before they ran, and how many of those were in-sample."""

    simulated: int = 0
    beside: int = 0
    in_sample: int = 0

    @property
    def total(self) -> int:
        return self.simulated + self.beside

    def __str__(self) -> str:
        return (f"{self.beside} measured, each new prediction kept beside the one it made before it ran "
                f"({self.in_sample} in-sample: by a calibration fitted to them); {self.simulated} simulated, "
                "their predictions replaced")


def reprice(store: Store, rows: Iterable[dict[str, Any]], book: ProfileBook, links: Iterable[LinkSpec] = (),
            fitted: Mapping[str, Fitted] | None = None) -> Repriced:
    """Re-price every finished attempt that has a plan, with the links it recorded (`links` for
    one that recorded none). `fitted`: what this machine's calibrations were fitted to
    (fitted_calibrations). The DB keeps a copy of each profile used."""
    links, kept, done = tuple(links), set(), Repriced()
    for row in rows:
        if row["status"] == RUNNING:
            continue
        own = recorded_links(row)
        found, profile = prediction(row, book, links if own is None else own)
        if profile is None:
            continue
        if found["profile_id"] not in kept:
            store.keep_profile(found["profile_id"], profile.to_dict())
            kept.add(found["profile_id"])
        if row["status"] == SIMULATED:
            store.reprice_simulated(row["id"], found)
            done.simulated += 1
            continue
        sample = in_sample(row, profile, fitted or {})
        store.reprice(row["id"], found, sample)
        done.beside += 1
        done.in_sample += sample
    return done
