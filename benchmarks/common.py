"""Shared helpers for benchmark scripts: results directory, provenance, JSON + PNG output.

Every result file records where it came from (`provenance`): the commit and whether the tree had
uncommitted changes, the command line, the host and Python, and a machine yardstick
(`machine_us`: the time of a fixed pure-Python loop), so that a figure can be traced to the code
and the machine that produced it. `benchmarks/report.py` refuses figures from files without it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def machine_us() -> float:
    """Best-of-5 microseconds for `sum(range(10000))`: a yardstick for comparing machines
    (about 120-150 us on a current 3 GHz core)."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            sum(range(10000))
        best = min(best, (time.perf_counter() - t0) / 200)
    return 1e6 * best


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)
    return out.stdout.rstrip() if out.returncode == 0 else ""  # porcelain lines start with a space


def provenance() -> dict[str, Any]:
    """Commit, dirty tree (tracked files changed outside benchmarks/results/), command, machine."""
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    files = [line[3:] for line in changed.splitlines() if line.strip()]
    return {
        "commit": _git("rev-parse", "HEAD").strip() or "unknown",
        "dirty": bool(files),
        "dirty_files": files[:20],
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": platform.node(),
        "python": platform.python_version(),
        "argv": sys.argv[1:],
        "machine_us": machine_us(),
        # 1/5/15-minute load averages when written: figures from a busy machine are labelled so
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }


def describe_policy(policy: object, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """A policy's name and every constructor parameter: the values given, else the instance's
    attribute of that name, else the default (infinities as the string "inf", for JSON)."""
    given = dict(given or {})
    params: dict[str, Any] = {}
    for name, p in inspect.signature(type(policy).__init__).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in given:
            value = given[name]
        elif hasattr(policy, name):
            value = getattr(policy, name)
        else:
            value = None if p.default is p.empty else p.default
        params[name] = _jsonable(value)
    return {"name": str(getattr(policy, "name", type(policy).__name__)), "params": params}


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # e.g. a TimeShareSpec
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json(name: str, data: dict[str, Any]) -> Path:
    """benchmarks/results/<name>.json with the data and its provenance."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "provenance": provenance(), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
    return path


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds of the process and of its reaped children)."""
    hz = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2 :].split()
        out[int(name)] = (int(f[1]), (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / hz)
    return out


def tree_cpu_s(roots: list[int], table: dict[int, tuple[int, float]] | None = None) -> dict[int, float]:
    """CPU seconds of each process in the trees under `roots` (their reaped children included).

    Two readings around a run give what the run cost in CPU (`cpu_between`): unlike its wall
    time, that barely moves when other jobs share the machine's cores. `table`: one
    `proc_table()` reading shared by several calls."""
    table = proc_table() if table is None else table
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out: dict[int, float] = {}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in out or pid not in table:
            continue
        out[pid] = table[pid][1]
        todo += kids.get(pid, [])
    return out


def cpu_ticks() -> list[int]:
    """The machine's CPU time counters (/proc/stat, all CPUs): user .. steal, in ticks."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def busy_between(before: list[int], after: list[int]) -> float:
    """The share of the machine's CPU time that was not idle between two `cpu_ticks` readings
    (how well a run kept the cores busy; other jobs count too)."""
    d = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(d)
    return 1.0 - (d[3] + d[4]) / total if total else 0.0


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the trees used between two `tree_cpu_s` readings (processes started since
    count whole; those ended since count through the parent that reaped them)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
