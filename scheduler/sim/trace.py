"""Trace record and replay in JSONL.

A *workload trace* is one header line, then one line per trajectory:

    {"type": "header", "scenario": "coding", "cluster": {...}, "priors": {...}, "model_mb": {...}}
    (optionally "node_events": [{"at_s": 60.0, "change": "lose", "node": "cpu14"}, ...])
    {"type": "trajectory", "id": "c0", "start_s": 0.0, "steps": [{"think_s": 7.9, "action": {...}}]}

A *result trace* is one line per completed action (`ActionRecord.to_dict`) plus a summary line.
Real runs are replayed by converting the live service's completed-action log (one JSON object
per action: trajectory_id, kind, key, units allowed, submitted_s, started_s, ended_s, units
used, target) into trajectories with `trajectories_from_action_log`: think time = gap between
an action's submission and the previous action's end; true T1 = measured execution time times
the speed-up at the units it ran with, under the kind's curve.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from scheduler.duration import Amdahl, ElasticityCurve
from scheduler.estimator import Prior
from scheduler.model import ResourceKind
from scheduler.sim.cluster import ApiSpec, ClusterSpec
from scheduler.sim.node_events import NodeEvent
from scheduler.sim.results import SimResult
from scheduler.sim.scenarios import Scenario
from scheduler.sim.workload import (
    SimAction,
    SimTrajectory,
    Step,
    speedup,
    trajectory_from_dict,
    trajectory_to_dict,
)


def cluster_to_dict(c: ClusterSpec) -> dict[str, Any]:
    images = {"image_store_mb": c.image_store_mb, "image_mb_per_s": c.image_mb_per_s}
    return {
        **(images if c.image_mb_per_s > 0 else {}),  # image stores: absent in older traces
        "cpu_nodes": c.cpu_nodes,
        "cores_per_node": c.cores_per_node,
        "numa_groups": c.numa_groups,
        "memory_mb_per_node": c.memory_mb_per_node,
        "gpus_total": c.gpus_total,
        "gpus_per_node": c.gpus_per_node,
        "gpu_memory_mb": c.gpu_memory_mb,
        "apis": {
            n: {
                "max_concurrency": a.max_concurrency,
                "quota_per_window": a.quota_per_window,
                "window_s": a.window_s,
            }
            for n, a in c.apis.items()
        },
    }


def cluster_from_dict(d: dict[str, Any]) -> ClusterSpec:
    apis = {n: ApiSpec(**a) for n, a in d.get("apis", {}).items()}
    return ClusterSpec(**{**{k: v for k, v in d.items() if k != "apis"}, "apis": apis})


def write_workload(scenario: Scenario, out: IO[str]) -> None:
    """Write `scenario` as a workload trace."""
    header: dict[str, Any] = {
        "type": "header",
        "scenario": scenario.name,
        "cluster": cluster_to_dict(scenario.cluster),
        "priors": {k: {"t1_s": p.t1_s, "p": p.p} for k, p in scenario.priors.items()},
        "model_mb": scenario.model_mb,
    }
    if scenario.node_events:  # omitted otherwise: older traces read the same
        header["node_events"] = [e.to_dict() for e in scenario.node_events]
    out.write(json.dumps(header) + "\n")
    for t in scenario.trajectories:
        out.write(json.dumps(trajectory_to_dict(t)) + "\n")


def read_workload(lines: Iterable[str]) -> Scenario:
    """Read a workload trace back into a `Scenario`."""
    header: dict[str, Any] = {}
    trajs: list[SimTrajectory] = []
    for line in lines:
        if not line.strip():
            continue
        d = json.loads(line)
        if d.get("type") == "header":
            header = d
        elif d.get("type") == "trajectory":
            trajs.append(trajectory_from_dict(d))
    priors = {k: Prior(float(v["t1_s"]), float(v.get("p", 0.0))) for k, v in header.get("priors", {}).items()}
    return Scenario(
        name=str(header.get("scenario", "trace")),
        trajectories=trajs,
        cluster=cluster_from_dict(header.get("cluster", {})),
        priors=priors,
        model_mb={k: int(v) for k, v in header.get("model_mb", {}).items()},
        node_events=[NodeEvent.from_dict(e) for e in header.get("node_events", [])],
    )


def save_workload(scenario: Scenario, path: Path) -> None:
    with path.open("w") as f:
        write_workload(scenario, f)


def load_workload(path: Path) -> Scenario:
    with path.open() as f:
        return read_workload(f)


def write_results(result: SimResult, out: IO[str]) -> None:
    """One line per action record, then `{"type": "summary", ...}`."""
    for r in result.records:
        out.write(json.dumps({"type": "action", **r.to_dict()}) + "\n")
    out.write(json.dumps({"type": "summary", **result.summary()}) + "\n")


def trajectories_from_action_log(
    records: Iterable[dict[str, Any]], curves: dict[str, ElasticityCurve] | None = None
) -> Iterator[SimTrajectory]:
    """Rebuild replayable trajectories from a live completed-action log (see module doc)."""
    curves = curves or {}
    by_traj: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_traj.setdefault(str(r["trajectory_id"]), []).append(r)
    for tid, recs in sorted(by_traj.items()):
        recs.sort(key=lambda r: float(r["submitted_s"]))
        start_s = float(recs[0]["submitted_s"])
        prev_end_s = start_s
        steps = []
        for r in recs:
            kind = str(r["kind"])
            curve = curves.get(kind, Amdahl(0.0))
            used = int(r.get("units", 1))
            exec_s = float(r["ended_s"]) - float(r["started_s"])
            t1_s = max(1e-6, exec_s * speedup(curve, used))
            act = SimAction(
                kind,
                ResourceKind(str(r["key"])),
                tuple(r.get("allowed", [used])),
                t1_s,
                curve,
                target=str(r.get("target", "")),
                memory_mb=int(r.get("memory_mb", 0)),
                api_quota=int(r.get("api_quota", 0)),
            )
            steps.append(Step(max(0.0, float(r["submitted_s"]) - prev_end_s), act))
            prev_end_s = float(r["ended_s"])
        yield SimTrajectory(tid, start_s, tuple(steps))
