"""Namespace launchers side by side: bubblewrap vs the built-in launcher, in one run.

For each launcher, interleaved round by round so that both see the same machine load:
1. sandbox start: a new trajectory's first action (`print(1)`), i.e. launcher + runner start
   + one exec, in ms                                                        -> p50, p90
2. warm exec: the same snippet in an already warm sandbox, in ms            -> p50, p90
3. worker start: opening the backend (stage the runner and pytest, probe)  -> median, in ms

Run: .venv/bin/python benchmarks/launchers.py [--n 40]
Writes benchmarks/results/launchers.json and launchers.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, percentile, write_json
from tangram_celery.common.config import SandboxConfig
from tangram_celery.sandbox import ExecRequest, open_sandbox

LAUNCHERS = ("bwrap", "builtin")
SNIPPET = ExecRequest(language="python", code="print(1)")


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40, help="rounds (sandbox starts per launcher)")
    args = ap.parse_args(argv)
    opened: dict[str, list[float]] = {k: [] for k in LAUNCHERS}
    boxes: dict[str, Any] = {}
    for _ in range(3):  # worker start: open (stage + probe) and close, interleaved
        for k in LAUNCHERS:
            t0 = time.perf_counter()
            box = open_sandbox(SandboxConfig(backend="namespace", namespace_launcher=k))
            opened[k].append(ms_since(t0))
            box.close()
    for k in LAUNCHERS:
        boxes[k] = open_sandbox(SandboxConfig(backend="namespace", namespace_launcher=k))
    start: dict[str, list[float]] = {k: [] for k in LAUNCHERS}
    warm: dict[str, list[float]] = {k: [] for k in LAUNCHERS}
    try:
        for _ in range(args.n):
            for k in LAUNCHERS:
                traj = uuid.uuid4().hex[:8]
                t0 = time.perf_counter()
                assert boxes[k].run(traj, SNIPPET).stdout == "1\n"
                start[k].append(ms_since(t0))
                t0 = time.perf_counter()
                assert boxes[k].run(traj, SNIPPET).stdout == "1\n"
                warm[k].append(ms_since(t0))
                boxes[k].close_trajectory(traj)
    finally:
        for box in boxes.values():
            box.close()
    out = {
        k: {
            "sandbox_start_ms": {"p50": percentile(start[k], 0.5), "p90": percentile(start[k], 0.9)},
            "warm_exec_ms": {"p50": percentile(warm[k], 0.5), "p90": percentile(warm[k], 0.9)},
            "worker_open_ms_median": statistics.median(opened[k]),
            "n": len(start[k]),
        }
        for k in LAUNCHERS
    }
    path = write_json("launchers", {"results": out, "raw": {"start_ms": start, "warm_ms": warm}})
    for k, r in out.items():
        print(
            f"{k:8s} start p50 {r['sandbox_start_ms']['p50']:.1f} ms (p90 {r['sandbox_start_ms']['p90']:.1f}), "
            f"warm exec p50 {r['warm_exec_ms']['p50']:.1f} ms, worker open {r['worker_open_ms_median']:.0f} ms"
        )
    _plot(start, warm)
    print(f"wrote {path}")
    return 0


def _plot(start: dict[str, list[float]], warm: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, data, title in ((axes[0], start, "new sandbox + first exec"), (axes[1], warm, "warm exec")):
        ax.boxplot([data[k] for k in LAUNCHERS], tick_labels=list(LAUNCHERS))
        ax.set_title(title)
        ax.set_ylabel("ms")
    fig.suptitle("namespace launchers (same run, interleaved)")
    fig.tight_layout()
    fig.savefig(RESULTS / "launchers.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
