"""Re-price recorded attempts with the profiles and cost model at hand now: after `codesign
profile` measured this machine, or after a release changed the cost model. Each attempt keeps
the links it recorded (a config's [links] are the user's, not the machine's). The measurements
stay; predicted_time, predicted_memory, the breakdown and what priced them are replaced, and
the store keeps the prediction they replace in the attempt's history."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable

from codesign.outcome import RUNNING
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


def reprice(store: Store, rows: Iterable[dict[str, Any]], book: ProfileBook, links: Iterable[LinkSpec] = ()) -> int:
    """Re-price every finished attempt that has a plan, with the links it recorded (`links` for
    one that recorded none); returns how many. The DB keeps a copy of each profile used."""
    links, kept, changed = tuple(links), set(), 0
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
        store.reprice(row["id"], found)
        changed += 1
    return changed
