"""Device profiles: the measured (or published) rates the cost model turns into seconds.

A profile says how fast one device runs each ZHEN mixer (effective FLOP/s forward and backward,
plus a fixed cost per call), how fast it moves memory, what a program dispatch costs, how
much aggregate speed n busy devices have (virtual CPU devices share this machine's cores) and,
for CPU devices, the link between local devices. GPU links come from the cluster's transport:
NVLink inside a host, EFAx4 or TCPx4 between hosts, defaults a config's [links.NAME] overrides.
Pure Python: `codesign profile` (engine/probe/) measures, the store keeps them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from codesign.config.types import MIXERS, ClusterSpec, Job
from codesign.hardware.datasheets import DATA_SHEETS, HBM_EFFICIENCY, DataSheet, data_sheet
from codesign.hardware.links import Link

log = logging.getLogger(__name__)

LAYER = "LAYER"  # the layer's own work: skip projection, token concat, LayerNorm
UNMEASURED = "LINEAR"  # the rate of kinds a profile has none of
ENCODER_PAIR = "ATTENTION x2"  # two ATTENTION mixers of a layer, their encoders vmapped in one call (a GPU
# profile measures it unless CODESIGN_PROFILE_PAIR=0; where a profile lacks it, the call is priced as one
# ATTENTION call of their summed work)




Points = tuple[tuple[float, float], ...]  # (FLOPs of one call, its seconds), FLOPs ascending


@dataclass(frozen=True)
class PowerModel:
    """Watts one device draws by what it does (for devices that share cores, the whole host's),
    and the power limits it accepts: what the cost model turns seconds into joules with."""

    idle: float  # doing nothing: a bubble, a wait, an unused device
    compute: float  # busy and compute-bound, at full clock
    memory: float  # busy and memory-bound (or launch-bound), at full clock
    communication: float  # in collectives and transfers between devices
    limits: tuple[float, float] = (0.0, 0.0)  # (lowest, highest) settable power limit; (0, 0): none
    floor: float = 0.0  # busy at the lowest clock (cost.power); 0: as idle
    source: str = "built-in"  # where the figures come from

    def to_dict(self) -> dict[str, Any]:
        """Watts as floats, so that a profile read back names the same figures (profile_id)."""
        watts = {k: float(getattr(self, k)) for k in ("idle", "compute", "memory", "communication", "floor")}
        return {**watts, "limits": [float(x) for x in self.limits], "source": self.source}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PowerModel:
        return cls(float(data["idle"]), float(data["compute"]), float(data["memory"]),
                   float(data["communication"]), tuple(float(x) for x in data.get("limits", (0, 0))),
                   float(data.get("floor", 0.0)), data.get("source", "measured"))


@dataclass(frozen=True)
class Rate:
    """One kind of work on one device: effective FLOP/s forward and backward, seconds per call.
    Measured points, where a profile has them, price a call instead (a GPU's time per call is
    far from a line in its FLOPs: launch-bound when small, at its rate only when large)."""

    forward: float
    backward: float
    overhead: float
    forward_points: Points = ()
    backward_points: Points = ()

    def __str__(self) -> str:  # for the profile's progress lines
        measured = f", {len(self.forward_points)} measured points" if self.forward_points else ""
        return (f"forward {self.forward:.3g} FLOP/s, backward {self.backward:.3g} FLOP/s, "
                f"{self.overhead * 1e6:.0f} us per call{measured}")

    def to_dict(self) -> dict[str, Any]:
        """The rate's fields; points only where measured (profiles without them stay as they were)."""
        data = {"forward": self.forward, "backward": self.backward, "overhead": self.overhead}
        if self.forward_points:
            data.update(forward_points=[list(p) for p in self.forward_points],
                        backward_points=[list(p) for p in self.backward_points])
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Rate:
        def points(key: str) -> Points:
            return tuple((float(work), float(seconds)) for work, seconds in data.get(key, ()))

        return cls(float(data["forward"]), float(data["backward"]), float(data["overhead"]),
                   points("forward_points"), points("backward_points"))


def interpolated(points: Points, flops: float, rate: float) -> float:
    """Seconds of a call of `flops` from measured points: piecewise linear in log-log between
    them; past the largest, that point's time plus the extra FLOPs at `rate`; below the
    smallest, the first segment's log-log slope kept within [0, 1] (launch-bound calls take
    about as long whatever their size)."""
    work, seconds = np.log(np.array(points)).T
    if flops >= points[-1][0]:
        return points[-1][1] + (flops - points[-1][0]) / rate
    x = np.log(max(flops, 1.0))
    if x >= work[0]:
        return float(np.exp(np.interp(x, work, seconds)))
    slope = np.clip((seconds[1] - seconds[0]) / (work[1] - work[0]), 0.0, 1.0) if len(points) > 1 else 0.0
    return float(np.exp(seconds[0] + slope * (x - work[0])))


@dataclass(frozen=True)
class SharedCoreFit:
    """What devices sharing one machine's cores add, fitted to real steps on it; hardware.shared_cores
    answers from these, devices of their own never read them."""

    speedup: tuple[tuple[int, float], ...] = ()  # n busy devices -> aggregate speed vs one; () = independent
    sync_traffic: float = 0.0  # gradient-sized arrays a gradient all-reduce also moves through memory
    # (XLA:CPU copies and transposes them around its all-reduce)
    contention: float = 0.0  # a pipeline: its work's excess over perfectly packed, per busy device
    # beyond one (its stages' small programs wake threads beside the others')
    lockstep: float = 0.0  # the extra share of a program's compute per op device beyond one, whose
    # devices meet at op's collectives between its computations and so cannot fill each other's stalls
    cores: int = 0  # how many the host has (an op group's fixed costs overlap on them); 0: unknown


@dataclass(frozen=True)
class Provenance:
    source: str = "built-in"  # "built-in" or "measured"
    versions: tuple[tuple[str, str], ...] = ()  # the libraries a measured profile depends on


@dataclass(frozen=True)
class Calibrated:
    """What this machine's calibration learned from its measured attempts (cost.learning), a layer
    over the hardware's answers: a factor on each stage's seconds per plan kind (plan.stage_kind),
    one on its peak bytes (an upper bound), and the calibration's version (0: none)."""

    plan_factors: tuple[tuple[str, float], ...] = ()
    memory_factor: float = 1.0
    version: int = 0

    def time_factor(self, kind: str) -> float:
        return dict(self.plan_factors).get(kind, 1.0)

    @property
    def least_time_factor(self) -> float:
        """No plan kind is priced below its uncalibrated seconds times this (for lower bounds)."""
        return min((1.0, *(f for _, f in self.plan_factors)))


@dataclass(frozen=True)
class DeviceProfile:
    """A device kind as the cost model prices it: its hardware (memory, rates, bandwidth, dispatch,
    link), what sharing cores adds (`shared`), its power model, where the figures come from
    (`provenance`) and what a calibration learned (`calibration`). Stored flat (to_dict), as before
    the concerns were separated, so that stored profiles keep their ids."""

    kind: str
    platform: str  # "gpu" | "cpu"
    memory: int  # bytes per device
    rates: tuple[tuple[str, tuple[tuple[str, Rate], ...]], ...]  # precision -> (mixer kind | LAYER -> Rate)
    bandwidth: float  # memory bytes/s (Adam's update, activation traffic)
    dispatch: float  # seconds the host spends per program call
    link: Link | None = None  # between local devices (CPU); GPUs use the transport's links
    update_scratch: float = 0.0  # gradient-sized scratch buffers of a compiled pp = 1 step, beyond the gradients
    activation_share: float = 1.0  # of the residuals and backward working set the model counts, what
    # a compiled step holds (GPU_ACTIVATION_SHARE on GPUs; the counts are XLA:CPU's)
    combines_collectives: bool = True  # XLA merges ZeRO-2's parameter all-gathers (GPU); CPU: one per array
    roofline: bool = True  # rates count FLOPs only, activation traffic is added at `bandwidth`;
    # False: measured rates already include the traffic at the probed widths
    gemms: bool = False  # mixers priced as the GEMMs they run (hardware.gemm), not at `rates`: a data-sheet GPU
    shared: SharedCoreFit = SharedCoreFit()
    power: PowerModel | None = None  # None: energy is not priced (a profile from before power models)
    provenance: Provenance = Provenance()
    calibration: Calibrated = Calibrated()

    def rate(self, precision: str, kind: str) -> Rate:
        """The kind's rate; two encoders' at one's where unmeasured; a kind the profile never
        measured (another model family's layers) at the LINEAR mixer's, a plain matmul."""
        table = dict(self.rates)
        rates = dict(table.get(precision) or table["fp32"])
        if kind in rates:
            return rates[kind]
        return rates["ATTENTION"] if kind == ENCODER_PAIR else rates[UNMEASURED]

    def share(self, busy: int) -> float:
        """Each of `busy` devices' speed relative to one device running alone."""
        speedup = self.shared.speedup
        if not speedup or busy <= 1:
            return 1.0
        ns, speeds = zip(*speedup)
        return float(np.interp(busy, ns, speeds)) / busy

    @property
    def source(self) -> str:
        return self.provenance.source

    @property
    def shares_cores(self) -> bool:
        """Virtual CPU devices: they, and the host launching their programs, share one machine.
        The one test of it; hardware.shared_cores prices what follows from it."""
        return self.platform == "cpu"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for part in ("shared", "provenance", "calibration"):
            data.update(data.pop(part))
        data["calibration"] = data.pop("version")
        data["rates"] = {p: {k: r.to_dict() for k, r in table} for p, table in self.rates}
        data["speedup"] = [list(s) for s in self.shared.speedup]
        data["versions"] = dict(self.provenance.versions)
        data["power"] = self.power.to_dict() if self.power else None
        data["plan_factors"] = dict(self.calibration.plan_factors)
        for name, unset in (("activation_share", 1.0), ("cores", 0), ("power", None), ("plan_factors", {}),
                            ("memory_factor", 1.0), ("calibration", 0), ("gemms", False)):  # profiles from before them keep their ids
            if data[name] == unset:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceProfile:
        rates = tuple((p, tuple((k, Rate.from_dict(r)) for k, r in table.items()))
                      for p, table in data["rates"].items())
        shared = SharedCoreFit(speedup=tuple((int(n), float(s)) for n, s in data.get("speedup", ())),
                               sync_traffic=float(data.get("sync_traffic", 0.0)),
                               contention=float(data.get("contention", 0.0)),
                               lockstep=float(data.get("lockstep", 0.0)), cores=int(data.get("cores", 0)))
        calibration = Calibrated(tuple(sorted((k, float(f)) for k, f in data.get("plan_factors", {}).items())),
                                 float(data.get("memory_factor", 1.0)), int(data.get("calibration", 0)))
        return cls(kind=data["kind"], platform=data["platform"], memory=int(data["memory"]), rates=rates,
                   bandwidth=float(data["bandwidth"]), dispatch=float(data["dispatch"]),
                   link=Link(**data["link"]) if data.get("link") else None,
                   update_scratch=float(data.get("update_scratch", 0.0)),
                   activation_share=float(data.get("activation_share", 1.0)),
                   combines_collectives=bool(data.get("combines_collectives", True)),
                   roofline=bool(data.get("roofline", True)), gemms=bool(data.get("gemms", False)), shared=shared,
                   power=PowerModel.from_dict(data["power"]) if data.get("power") else None,
                   provenance=Provenance(data.get("source", "measured"),
                                         tuple(sorted(data.get("versions", {}).items()))),
                   calibration=calibration)


def _uniform(matmul: float, overhead: float, elementwise: float) -> tuple[tuple[str, Rate], ...]:
    """Every mixer at one effective matmul rate (backward a little less efficient); the layer's
    own work (the skip projection; its LayerNorm and concat are memory traffic) at another."""
    rates = [(k, Rate(matmul, 0.8 * matmul, overhead)) for k in MIXERS]
    return (*rates, (LAYER, Rate(elementwise, elementwise, overhead)))


# XLA:GPU's compiled steps hold about half the residuals and backward scratch the model counts
# (XLA:CPU's, from which the counts were fitted): fitted to an H100's jobs of bench/gpu_cost.toml
# (bench/RESULTS.md, "Predicted memory"); tests/test_cost.py holds it to them.
GPU_ACTIVATION_SHARE = 0.55


# Busy watts as shares of TDP where nothing measured them: compute-bound kernels run at the
# limit; memory- and launch-bound ones, and collectives, leave the SMs partly idle; at its
# lowest clock a busy GPU still draws its memory's and fabric's share. `codesign profile` on a
# GPU measures the busy figures in its timed loops.
MEMORY_BOUND_TDP, COMMUNICATION_TDP, FLOOR_TDP = 0.65, 0.45, 0.25


def data_sheet_power(sheet: DataSheet) -> PowerModel:
    return PowerModel(idle=sheet.idle, compute=sheet.tdp, memory=MEMORY_BOUND_TDP * sheet.tdp,
                      communication=COMMUNICATION_TDP * sheet.tdp, limits=(sheet.lowest_limit, sheet.tdp),
                      floor=FLOOR_TDP * sheet.tdp, source="data sheet")


def _gpu(kind: str, sheet: DataSheet) -> DeviceProfile:
    """A GPU from its data sheet. The efficiencies (50% of peak for the mixers' FLOPs, 80% of HBM
    for memory traffic, 10 us per mixer call's kernels) were fitted to the seed model's flat step
    (EngineOptions.flat_state) at batch 1024 in bf16, on an H200 and an H100 (bench/RESULTS.md);
    tests/test_cost.py holds the H100 to it. Where a GPU has a measured built-in profile
    (MEASURED: the H200), that one prices it."""
    launch = 10e-6  # the kernels of one mixer call, and the gaps between them
    return DeviceProfile(kind=kind, platform="gpu", memory=int(sheet.memory_gib * 2**30),
                         rates=(("bf16", _uniform(0.5 * sheet.bf16, launch, 0.1 * sheet.bf16)),
                                ("fp32", _uniform(0.5 * sheet.tf32, launch, 0.1 * sheet.tf32))),
                         bandwidth=HBM_EFFICIENCY * sheet.bandwidth, dispatch=30e-6,
                         activation_share=GPU_ACTIVATION_SHARE, power=data_sheet_power(sheet), gemms=True)


# GPUs as `codesign profile` measured them (measured/KIND.json), in place of their data sheet's
# profile, with the data sheet's memory: its mixer points span the widths and micro-batches a sweep
# prices, where the data sheet's one efficiency was fitted to the seed model's step alone. The
# H200's is the profile of one bench/gpu_check.sh run (bench/RESULTS.md, "Cost model on GPUs");
# tests/test_cost.py holds it to that run's jobs and to a model of widths it never probed.
MEASURED = Path(__file__).with_name("measured")


def _measured_gpus() -> dict[str, DeviceProfile]:
    return {path.stem: with_power(DeviceProfile.from_dict(json.loads(path.read_text())))
            for path in MEASURED.glob("*.json")}


def with_power(profile: DeviceProfile) -> DeviceProfile:
    """A profile measured before profiles measured power gets its data sheet's power model (a
    CPU's: the assumed one), so that every profile prices joules."""
    if profile.power is not None:
        return profile
    sheet = data_sheet(profile.kind)
    power = data_sheet_power(sheet) if sheet else CPU_POWER if profile.shares_cores else None
    return dataclasses.replace(profile, power=power) if power else profile


# Virtual CPU devices share the host: its power, not a device's. This VM exposes no power
# counter; assumed: two cores' share of a 225 W, 64-core EPYC package (3.5 W per busy core,
# about 1 W idle), memory-bound work drawing a little less. No power limit to set.
CPU_POWER = PowerModel(idle=2.0, compute=7.0, memory=6.0, communication=5.0, source="assumed")

BUILTIN: dict[str, DeviceProfile] = {
    **{kind: _gpu(kind, sheet) for kind, sheet in DATA_SHEETS.items()},
    **_measured_gpus(),
    # This machine's CPU (2 cores) as `codesign profile` measured it on a quiet machine
    # (2026-11-26, JAX 0.10.2), fitted to its 14 real probe steps: what tests and a sweep with
    # CODESIGN_PROFILE=builtin price with.
    "cpu": DeviceProfile(kind="cpu", platform="cpu", memory=8 * 2**30,
                         rates=(("fp32", (("DOT", Rate(1.66e11, 1.66e11, 6e-5)),
                                          ("LINEAR", Rate(3.3e10, 5.6e9, 1.6e-5)),
                                          ("ATTENTION", Rate(1.2e11, 2.1e10, 5.9e-5)),
                                          # x52 forward, x6.1 backward: the measured speed-up of the
                                          # convolution as shifted multiply-adds (network.SameConv);
                                          # backward x2.5 again, written out (network.shifted_conv:
                                          # 6.7 against 2.7 us per sample between batch 8 and 128)
                                          ("CONVOLUTION", Rate(6.7e10, 2.6e10, 8.3e-5)),
                                          (LAYER, Rate(4.9e10, 3.4e10, 9.4e-6)))),),
                         bandwidth=2.1e10, dispatch=9.7e-5, link=Link(3.1e9, 9.4e-6),
                         combines_collectives=False, roofline=False,
                         shared=SharedCoreFit(speedup=((1, 1.0), (2, 1.11), (4, 1.37), (8, 1.52)), sync_traffic=2.4,
                                              contention=0.044, lockstep=0.14),
                         power=CPU_POWER),
}


def library_versions() -> dict[str, str]:
    """What a measured profile depends on besides the device, read without importing JAX."""
    return {name: metadata.version(name) for name in ("jax", "jaxlib")}


def builtin_kind(device_kind: str) -> str | None:
    """The built-in profile for a JAX device kind such as "NVIDIA H100 80GB HBM3"."""
    return next((k for k in BUILTIN if k.lower() in device_kind.lower()), None)


@dataclass
class ProfileBook:
    """The profiles at hand: built-in ones overlaid with measured ones, and which kind this
    machine's devices are on each platform."""

    profiles: dict[str, DeviceProfile] = field(default_factory=lambda: dict(BUILTIN))
    local: dict[str, str] = field(default_factory=lambda: {"cpu": "cpu", "gpu": "H100", "auto": "H100"})

    def add(self, profile: DeviceProfile) -> None:
        """Keep a measured profile under its device kind (which platform it is local to is `local`'s)."""
        self.profiles[profile.kind] = with_power(profile)

    @property
    def kinds(self) -> list[str]:
        return sorted(self.profiles)

    def known(self, kind: str) -> bool:
        return kind in self.profiles or builtin_kind(kind) is not None

    def for_job(self, job: Job) -> DeviceProfile:
        return self.for_cluster(job.cluster, job.platform)

    def for_cluster(self, cluster: ClusterSpec, platform: str) -> DeviceProfile:
        """A simulated cluster's declared device, else this machine's device of the platform."""
        kind = cluster.device if cluster.is_simulated else self.local.get(platform, platform)
        found = self.profiles.get(kind) or self.profiles.get(builtin_kind(kind) or "")
        if found is None:
            log.warning("no profile for device kind %r; pricing it as an H100", kind)
            return self.profiles["H100"]
        return found


def profile_id(profile: DeviceProfile) -> str:
    """Names a profile's exact figures, e.g. "cpu@3fa9c1e2b4d0": what an attempt records it was
    priced by, and what the results DB keeps a copy under."""
    digest = hashlib.sha256(json.dumps(profile.to_dict(), sort_keys=True).encode()).hexdigest()
    return f"{profile.kind}@{digest[:12]}"
