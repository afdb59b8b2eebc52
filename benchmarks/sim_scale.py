"""The simulator at scale (issue 39): 10^6 actions on 100 CPU nodes and 20 GPU nodes.

The `mixed` scenario (`scheduler.sim.scenarios.MixedParams`): 50,000 coding trajectories
(`CodingParams`' turns and test suite: 16 CPU actions each on average) and 100,000 scoring
trajectories (`MopdParams`' 10 teachers: 2 GPU calls each), each starting at a uniform time
in the first 30 simulated minutes, on 100 nodes of 256 cores and 20 nodes of 8 GPUs, under
`tangram-fast`. About 10^6 actions; the target is 5 minutes on this machine.

Rounds are at most `--round-gap-s` apart in simulated time (`ExecParams.round_gap_s`, default
0.05 s): the events of 50 ms are decided together, as the live loop decides together what one
read of its streams brings (about 1,100 events a second arrive here). `--compare` also runs
1/`N` of the workload (the same cluster, `arrival_s` / N) with a round at every event time and
with the gap, to show what the gap changes.

Records wall and CPU seconds (the machine is shared: its load average is in the provenance),
the actions, rounds and the run's summary, in benchmarks/results/sim_scale.json (+ PNG; `--name`
another name, e.g. for another round gap).

    .venv/bin/python benchmarks/sim_scale.py [--scale 0.1] [--round-gap-s 0.05] [--compare 10] [--name NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.common import RESULTS, write_json  # noqa: E402
from scheduler.sim import Simulator, build, make_policy  # noqa: E402
from scheduler.sim.results import SimResult  # noqa: E402
from scheduler.sim.scenarios import MixedParams  # noqa: E402

TARGET_S = 300.0
KEYS = ("avg_act_s", "p50_act_s", "p99_act_s", "avg_queue_s", "makespan_s", "rounds")
KEYS_MS = ("decision_median_ms", "decision_p99_ms", "decision_max_ms")


def run(scale: float, gap_s: float) -> tuple[SimResult, dict[str, Any]]:
    """Build and simulate `scale` of the mixed workload with rounds `gap_s` apart."""
    p = MixedParams()
    over = {
        "coding_batch": round(p.coding_batch * scale),
        "mopd_batch": round(p.mopd_batch * scale),
        "arrival_s": p.arrival_s * scale,
    }
    t0 = time.perf_counter()
    sc = build("mixed", over)
    sc.exec_params = dataclasses.replace(sc.exec_params, round_gap_s=gap_s)
    build_s = time.perf_counter() - t0
    sim = Simulator(sc, make_policy("tangram-fast", sc))
    gc.collect()
    gc.freeze()  # the workload lives to the end: the collector need not walk it again and again
    w0, c0 = time.perf_counter(), time.process_time()
    result = sim.run()
    wall_s, cpu_s = time.perf_counter() - w0, time.process_time() - c0
    gc.unfreeze()
    s = result.summary()
    kinds = s["avg_act_by_kind_s"]
    out = {
        "params": {**over, "round_gap_s": gap_s, "cpu_nodes": p.cpu_nodes, "gpu_nodes": p.gpu_nodes},
        "actions": sc.num_actions,
        "completed": s["actions"],
        "unfinished": s["unfinished"],
        "build_s": build_s,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "actions_per_cpu_s": sc.num_actions / cpu_s,
        **{k: s[k] for k in KEYS},
        **{k: s[k] for k in KEYS_MS},
        "avg_act_cpu_s": _mean(kinds, lambda k: not k.startswith("reward:"), result),
        "avg_act_gpu_s": _mean(kinds, lambda k: k.startswith("reward:"), result),
    }
    print(
        f"scale {scale} gap {gap_s}: {sc.num_actions:,} actions, {s['rounds']:,} rounds, "
        f"wall {wall_s:.1f} s, cpu {cpu_s:.1f} s, avg ACT {s['avg_act_s']:.3f} s",
        flush=True,
    )
    return result, out


def _mean(kinds: dict[str, float], pick: Any, result: SimResult) -> float:
    recs = [r.act_s for r in result.records if pick(r.kind)]
    return sum(recs) / len(recs) if recs else float("nan")


def plot(result: SimResult, main: dict[str, Any], path: Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 1]})
    per_min: dict[int, int] = {}
    for r in result.records:
        per_min[int(r.ended_s // 60)] = per_min.get(int(r.ended_s // 60), 0) + 1
    xs = sorted(per_min)
    ax1.plot(xs, [per_min[x] for x in xs], label="actions completed per simulated minute")
    act = result.act_over_time(60.0)
    ax1b = ax1.twinx()
    ax1b.plot([t / 60 for t, _ in act], [a for _, a in act], color="C1", label="average ACT (s)")
    ax1.set_xlabel("simulated minute")
    ax1.set_ylabel("actions / min")
    ax1b.set_ylabel("average ACT (s)", color="C1")
    ax1.set_title(f"{main['actions']:,} actions, 100 CPU + 20 GPU nodes, tangram-fast")
    ax2.bar(["wall", "CPU"], [main["wall_s"], main["cpu_s"]], color=["C0", "C2"])
    ax2.axhline(TARGET_S, color="k", ls="--", lw=1, label="target 5 min")
    ax2.set_ylabel("seconds")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="share of the workload (1: ~10^6 actions)")
    ap.add_argument("--round-gap-s", type=float, default=0.05)
    ap.add_argument("--compare", type=int, default=0, help="also run 1/N of it with and without the gap")
    ap.add_argument("--name", default="sim_scale", help="result files' name (benchmarks/results/NAME.*)")
    args = ap.parse_args()
    result, main_run = run(args.scale, args.round_gap_s)
    data: dict[str, Any] = {"run": main_run, "target_s": TARGET_S, "met": main_run["wall_s"] <= TARGET_S}
    plot(result, main_run, RESULTS / f"{args.name}.png")
    del result
    if args.compare:
        small = args.scale / args.compare
        data["compare"] = {"every_event": run(small, 0.0)[1], "gap": run(small, args.round_gap_s)[1]}
    path = write_json(args.name, data)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
