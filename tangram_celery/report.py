"""`tangram report`: PNG plots of a run from the scheduler's completed-action log.

Reads `<state_dir>/actions.jsonl` and writes `act_over_time.png` (ACT of every action against
its completion time, with a rolling mean per action kind) and `utilisation.png` (units in use
over capacity, per pool, sampled every `step_s`), plus a `summary.json`.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from tangram_celery.common.config import TangramConfig
from tangram_celery.common.errors import TangramError


def log_files(path: Path) -> list[Path]:
    """The run log and its rotated predecessors (`path.1`, `path.2`, ...), oldest first."""
    rotated = []
    i = 1
    while path.with_name(f"{path.name}.{i}").exists():
        rotated.append(path.with_name(f"{path.name}.{i}"))
        i += 1
    return [*reversed(rotated), *([path] if path.exists() else [])]


def load_log(path: Path) -> list[dict[str, Any]]:
    """Every record of the run log at `path`, its rotated files first (oldest first)."""
    files = log_files(path)
    if not files:
        raise TangramError(f"no action log at {path}: run a workload first (the scheduler writes it)")
    recs = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    if not recs:
        raise TangramError(f"{path} is empty: no action has completed yet")
    return recs


def capacities(cfg: TangramConfig) -> dict[str, int]:
    caps = {f"cpu:{n.name}": n.cores for n in cfg.nodes.cpu}
    caps.update({f"gpu:{g.name}": g.num_gpus for g in cfg.nodes.gpu})
    caps.update({f"api:{a.name}": a.max_concurrency or 1 for a in cfg.apis})
    return caps


def utilisation(
    recs: list[dict[str, Any]], caps: dict[str, int], step_s: float
) -> dict[str, list[tuple[float, float]]]:
    """Per pool: (t since start, fraction of units in use), from the [started, ended) intervals."""
    t0 = min(r["started_s"] for r in recs)
    t1 = max(r["ended_s"] for r in recs)
    by_pool: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in recs:
        by_pool[r["pool"]].append(r)
    out: dict[str, list[tuple[float, float]]] = {}
    n = max(1, int((t1 - t0) / step_s) + 1)
    for pool, rs in by_pool.items():
        cap = caps.get(pool) or max(r["units"] for r in rs)
        series = []
        for i in range(n):
            t = t0 + i * step_s
            used = sum(r["units"] for r in rs if r["started_s"] <= t < r["ended_s"])
            series.append((t - t0, min(1.0, used / cap)))
        out[pool] = series
    return out


def summarize(recs: list[dict[str, Any]]) -> dict[str, Any]:
    by_kind: dict[str, list[float]] = defaultdict(list)
    for r in recs:
        by_kind[r["kind"]].append(r["ended_s"] - r["submitted_s"])
    acts = sorted(r["ended_s"] - r["submitted_s"] for r in recs)
    return {
        "actions": len(recs),
        "mean_act_s": statistics.fmean(acts),
        "p50_act_s": acts[len(acts) // 2],
        "p99_act_s": acts[min(len(acts) - 1, int(0.99 * len(acts)))],
        "by_kind": {k: {"n": len(v), "mean_act_s": statistics.fmean(v)} for k, v in sorted(by_kind.items())},
        "by_status": {
            s: sum(1 for r in recs if r["status"] == s) for s in sorted({r["status"] for r in recs})
        },
    }


def write_report(
    cfg: TangramConfig, out_dir: Path, log_path: Path | None = None, step_s: float = 0.5
) -> list[Path]:
    """Write the plots and the summary into `out_dir`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = load_log(log_path or Path(cfg.state_dir) / "actions.jsonl")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = min(r["submitted_s"] for r in recs)
    if step_s is None:
        step_s = max(0.01, (max(r["ended_s"] for r in recs) - t0) / 400)

    fig, ax = plt.subplots(figsize=(9, 4))
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in recs:
        by_kind[r["kind"]].append(r)
    for kind, rs in sorted(by_kind.items()):
        rs.sort(key=lambda r: r["ended_s"])
        xs = [r["ended_s"] - t0 for r in rs]
        ys = [r["ended_s"] - r["submitted_s"] for r in rs]
        pts = ax.scatter(xs, ys, s=6, alpha=0.35)
        w = max(1, len(ys) // 20)
        roll = [statistics.fmean(ys[max(0, i - w) : i + 1]) for i in range(len(ys))]
        ax.plot(xs, roll, color=pts.get_facecolor()[0], label=f"{kind} (n={len(rs)})")
    ax.set_xlabel("time since first submit (s)")
    ax.set_ylabel("ACT (s)")
    ax.set_yscale("log")
    ax.set_title("Action completion time over the run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    act_png = out_dir / "act_over_time.png"
    fig.savefig(act_png, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4))
    for pool, series in sorted(utilisation(recs, capacities(cfg), step_s).items()):
        ax.plot([t for t, _ in series], [100 * u for _, u in series], label=pool)
    ax.set_xlabel("time since first start (s)")
    ax.set_ylabel("units in use (%)")
    ax.set_ylim(0, 105)
    ax.set_title("Utilisation per pool")
    ax.legend(fontsize=8)
    fig.tight_layout()
    util_png = out_dir / "utilisation.png"
    fig.savefig(util_png, dpi=100)
    plt.close(fig)

    summary = out_dir / "summary.json"
    summary.write_text(json.dumps(summarize(recs), indent=2))
    return [act_png, util_png, summary]
