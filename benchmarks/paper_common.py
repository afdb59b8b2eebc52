"""Shared helpers of the paper_* benchmarks: run, tabulate, save JSON (with provenance) + PNG.

Every policy a script runs is recorded under its label with its full parameters (`POLICIES`),
and `save` writes them and the provenance (commit, dirty tree, machine yardstick) into the file.
"""

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

from benchmarks.common import describe_policy, provenance  # noqa: E402
from scheduler.policies.base import Policy  # noqa: E402
from scheduler.sim import Scenario, SimResult, make_policy, simulate  # noqa: E402
from scheduler.sim.cli import policy_label  # noqa: E402

# label -> {"name", "params"} of every policy run by this process (written by `save`)
POLICIES: dict[str, dict[str, Any]] = {}


def build(name: str, scenario: Scenario, label: str = "", **params: Any) -> tuple[str, Policy]:
    """The policy `name` with `params` for `scenario`, and its label (recorded in `POLICIES`)."""
    pol = make_policy(name, scenario, **params)
    label = label or policy_label(name, params)
    described = describe_policy(pol, params)
    if label in POLICIES and POLICIES[label]["params"] != described["params"]:
        # the same label for differently sized deployments (e.g. by scenario): keep them apart
        POLICIES.setdefault(f"{label} @{scenario.name}", described)
    else:
        POLICIES[label] = described
    return label, pol


def run(
    scenario: Scenario, policy: str | Policy, label: str = "", **params: Any
) -> tuple[SimResult, dict[str, Any]]:
    """Simulate and print one summary line. `policy` is a name (built with `params`) or an
    instance (then `label` names it)."""
    if isinstance(policy, str):
        label, policy = build(policy, scenario, label, **params)
    else:
        label = label or policy.name
        POLICIES.setdefault(label, describe_policy(policy))
    t0 = time.perf_counter()
    result = simulate(scenario, policy)
    result.policy = label
    summary = result.summary()
    print(
        f"  {scenario.name:<10} {label:<44} actions={summary['actions']:>6} "
        f"avg_act={summary['avg_act_s']:8.2f}s p99={summary['p99_act_s']:8.1f}s "
        f"failed={summary['failed_actions']:>5} wall={time.perf_counter() - t0:5.1f}s",
        flush=True,
    )
    return result, summary


def strongest(
    scenario: Scenario, name: str, grid: list[dict[str, Any]], quiet: bool = True
) -> tuple[dict[str, Any], float, dict[str, float]]:
    """The configuration of baseline `name` with the lowest average ACT on `scenario`: (its
    parameters, its ACT, every configuration's ACT by label). A configuration that cannot serve
    every call (fewer groups than services) counts as infinitely slow."""
    tried: dict[str, float] = {}
    best: tuple[float, dict[str, Any]] | None = None
    for params in grid:
        label, pol = build(name, scenario, **params)
        result = simulate(scenario, pol)
        act = result.avg_act_s() if result.unfinished == 0 else float("inf")
        tried[label] = act
        if not quiet:
            print(f"    {label:<56} avg_act={act:8.3f}s", flush=True)
        if best is None or act < best[0]:
            best = (act, params)
    assert best is not None
    return best[1], best[0], tried


# What an operator can configure (scheduler/policies/dedicated_gpu.py, cold_start.py).
DEDICATED_GRID: list[dict[str, Any]] = [
    {"tp": tp, "replicas": r, "max_concurrent": c}
    for tp in (1, 2, 4, 8)
    for r in ("one", "load")
    for c in (1, None)
]
COLD_START_GRID: list[dict[str, Any]] = [
    {"keep_alive_s": k, "load_from": src}
    for k in (0.0, 10.0, 60.0, 600.0, float("inf"))
    for src in ("storage", "memory")
]
DEDICATED_PAPER: dict[str, Any] = {}  # one TP4 group per service, one call at a time
COLD_START_PAPER: dict[str, Any] = {}  # load from storage on every call, nothing kept


def save(name: str, data: dict[str, Any]) -> Path:
    """benchmarks/results/<name>.json: provenance, the policies run (label -> parameters), data."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    out = {"benchmark": name, "provenance": provenance(), "policies": POLICIES, **data}
    path.write_text(json.dumps(out, indent=2, default=_default) + "\n")
    print(f"wrote {path}")
    return path


def _default(value: Any) -> Any:
    return float(value)


def png(name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{name}.png"


def ratio(a: float, b: float) -> float:
    """a / b, guarded."""
    return a / b if b > 0 else float("inf")
