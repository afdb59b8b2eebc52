"""What the simulator replays: trajectories of (think time, action) steps, closed loop.

A trajectory's next step starts `think_s` (LLM generation, off the managed pools) after its
previous action completes. Each `SimAction` carries its *true* single-unit duration and true
elasticity curve; the policies never see them, only the estimator's per-kind estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.duration import Amdahl, ElasticityCurve, Table
from scheduler.model import CostVector, Elastic, ResourceKind

_COSTS: dict[tuple[object, ...], CostVector] = {}


@dataclass(frozen=True, slots=True)
class SimAction:
    """One action as generated: its cost vector and its true duration model."""

    kind: str
    key: ResourceKind
    units: tuple[int, ...]
    t1_s: float
    curve: ElasticityCurve = field(default_factory=lambda: Amdahl(0.0))
    target: str = ""
    memory_mb: int = 0
    api_quota: int = 0
    gpu_memory_mb: int = 0  # weights of the GPU service it calls (all shards)
    malleable: bool = False  # may take (and give back) cores while it runs (`CostVector.malleable`)
    image: str = ""  # its trajectory's container image ("": the host toolchain; `scheduler.images`)
    image_mb: int = 0

    def cost(self) -> CostVector:
        """Its cost vector (frozen: one per distinct cost, shared by the actions that have it,
        not built again at every submission of 10^6 actions)."""
        key = (self.key, self.units, self.memory_mb, self.gpu_memory_mb, self.api_quota, self.malleable)
        hit = _COSTS.get(key)
        if hit is None:
            if len(_COSTS) > 65536:
                _COSTS.clear()
            hit = _COSTS[key] = CostVector(
                self.key,
                Elastic(self.units),
                self.memory_mb,
                self.gpu_memory_mb,
                self.api_quota,
                malleable=self.malleable,
            )
        return hit

    def true_duration_s(self, units: float) -> float:
        """True execution time at `units` (fractional units: linear in the speed-up)."""
        return self.t1_s / speedup(self.curve, units)


def speedup(curve: ElasticityCurve, units: float) -> float:
    """E(m) * m, interpolated linearly between integers; below one unit it is time-slicing."""
    if units <= 1.0:
        return max(units, 1e-9) * curve.efficiency(1)
    lo = int(units)
    s_lo = curve.efficiency(lo) * lo
    if units == lo:
        return s_lo
    s_hi = curve.efficiency(lo + 1) * (lo + 1)
    return s_lo + (s_hi - s_lo) * (units - lo)


@dataclass(frozen=True, slots=True)
class Step:
    think_s: float
    action: SimAction


@dataclass(frozen=True, slots=True)
class SimTrajectory:
    trajectory_id: str
    start_s: float
    steps: tuple[Step, ...]


# ---- JSON -----------------------------------------------------------------------------------
def curve_to_dict(curve: ElasticityCurve) -> dict[str, Any]:
    if isinstance(curve, Amdahl):
        return {"amdahl": curve.p}
    if isinstance(curve, Table):
        return {"table": [list(p) for p in curve.points]}
    return {"amdahl": 0.0}


def curve_from_dict(d: dict[str, Any]) -> ElasticityCurve:
    if "table" in d:
        return Table(tuple((int(m), float(e)) for m, e in d["table"]))
    return Amdahl(float(d.get("amdahl", 0.0)))


def action_to_dict(a: SimAction) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": a.kind,
        "key": str(a.key),
        "units": list(a.units),
        "t1_s": round(a.t1_s, 6),
        "curve": curve_to_dict(a.curve),
        "target": a.target,
        "memory_mb": a.memory_mb,
        "api_quota": a.api_quota,
        "gpu_memory_mb": a.gpu_memory_mb,
    }
    if a.malleable:  # omitted otherwise: older traces read the same
        out["malleable"] = True
    if a.image:
        out["image"], out["image_mb"] = a.image, a.image_mb
    return out


def action_from_dict(d: dict[str, Any]) -> SimAction:
    return SimAction(
        kind=str(d["kind"]),
        key=ResourceKind(str(d["key"])),
        units=tuple(int(u) for u in d["units"]),
        t1_s=float(d["t1_s"]),
        curve=curve_from_dict(d.get("curve", {})),
        target=str(d.get("target", "")),
        memory_mb=int(d.get("memory_mb", 0)),
        api_quota=int(d.get("api_quota", 0)),
        gpu_memory_mb=int(d.get("gpu_memory_mb", 0)),
        malleable=bool(d.get("malleable", False)),
        image=str(d.get("image", "")),
        image_mb=int(d.get("image_mb", 0)),
    )


def trajectory_to_dict(t: SimTrajectory) -> dict[str, Any]:
    return {
        "type": "trajectory",
        "id": t.trajectory_id,
        "start_s": t.start_s,
        "steps": [{"think_s": round(s.think_s, 6), "action": action_to_dict(s.action)} for s in t.steps],
    }


def trajectory_from_dict(d: dict[str, Any]) -> SimTrajectory:
    return SimTrajectory(
        trajectory_id=str(d["id"]),
        start_s=float(d.get("start_s", 0.0)),
        steps=tuple(Step(float(s["think_s"]), action_from_dict(s["action"])) for s in d["steps"]),
    )
