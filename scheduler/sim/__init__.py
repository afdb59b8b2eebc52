"""Trace-driven discrete-event simulator: the same policy objects, simulated time.

`scenarios` generates workloads (coding, MOPD, DeepSearch), `cluster` holds the testbed shapes
and execution costs, `engine.Simulator` runs one policy over one scenario (its CPU and GPU
execution in `cpu_exec` and `gpu_exec`), `trace` records and replays workloads as JSONL. Assumptions: docs/simulator.md.
"""

from scheduler.sim.cluster import ApiSpec, ClusterSpec, ExecParams
from scheduler.sim.engine import Simulator
from scheduler.sim.results import ActionRecord, SimResult
from scheduler.sim.runner import make_policy, simulate
from scheduler.sim.scenarios import Scenario, build

__all__ = [
    "ActionRecord",
    "ApiSpec",
    "ClusterSpec",
    "ExecParams",
    "Scenario",
    "SimResult",
    "Simulator",
    "build",
    "make_policy",
    "simulate",
]
