"""Shared helpers of the paper_* benchmarks: run, tabulate, save JSON + PNG."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"

from scheduler.policies.base import Policy  # noqa: E402
from scheduler.sim import Scenario, SimResult, simulate  # noqa: E402


def run(scenario: Scenario, policy: str | Policy, label: str = "") -> tuple[SimResult, dict[str, Any]]:
    """Simulate and print one summary line (`label` names a configured policy instance)."""
    t0 = time.perf_counter()
    result = simulate(scenario, policy)
    summary = result.summary()
    name = label or (policy if isinstance(policy, str) else policy.name)
    print(
        f"  {scenario.name:<10} {name:<20} actions={summary['actions']:>6} "
        f"avg_act={summary['avg_act_s']:8.2f}s p99={summary['p99_act_s']:8.1f}s "
        f"failed={summary['failed_actions']:>5} wall={time.perf_counter() - t0:5.1f}s",
        flush=True,
    )
    return result, summary


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
    print(f"wrote {path}")
    return path


def png(name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{name}.png"


def ratio(a: float, b: float) -> float:
    """a / b, guarded."""
    return a / b if b > 0 else float("inf")
