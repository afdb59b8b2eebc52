"""Bounded time sharing (issue 18, item 3), side by side in one run: the coding sweep of
`paper_cpu_scaling.py` (batch 128-1536 on 15 x 256 cores, 5-20 nodes at batch 1280) under
`tangram-fast` with time sharing (its default), the same with it off (`share=False`),
`tangram-dp` and `static-pod` at Kubernetes defaults; and the cost of a round that places
sharers on a saturated node.

Per point and policy: average, p99 ACT, the longest total wait of one trajectory (its actions'
queueing summed: FCFS's argument is that a starved action stalls its trajectory), the same with
the time its actions ran slower than alone (a sharer starts at once but slowed), the test
suites' average ACT (the long actions sharing slows), the last trajectory's end (a rollout
step's length), actions started sharing, and the decision time inside the run (every round:
policy, riders and sharers).

    .venv/bin/python benchmarks/time_share.py      # about 10 minutes

Writes benchmarks/results/time_share.json and time_share.png.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import matplotlib.pyplot as plt
from paper_common import POLICIES, png, save

from benchmarks.common import describe_policy
from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import get_policy
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState, CpuNode
from scheduler.round import Round
from scheduler.sim import ClusterSpec, Scenario, build, make_policy, simulate

SHARE, EXCLUSIVE, DP, POD = "tangram-fast", "tangram-fast (exclusive)", "tangram-dp", "static-pod"
LABELS = [SHARE, EXCLUSIVE, DP, POD]
POINTS = [(15, b) for b in (128, 256, 512, 1024, 1536)] + [(n, 1280) for n in (5, 10, 15, 20)]


def policy(label: str, sc: Scenario) -> Any:
    pol = get_policy("tangram-fast", share=False) if label == EXCLUSIVE else make_policy(label, sc)
    POLICIES.setdefault(label, describe_policy(pol, {"share": False} if label == EXCLUSIVE else {}))
    return pol


def one(sc: Scenario, label: str) -> dict[str, float]:
    """One simulated run's figures (see the module doc)."""
    t0 = time.perf_counter()
    res = simulate(sc, policy(label, sc))
    s = res.summary()
    out = {
        "avg_act_s": float(s["avg_act_s"]),
        "p99_act_s": float(s["p99_act_s"]),
        "max_trajectory_wait_s": float(s["max_trajectory_wait_s"]),
        "max_trajectory_stall_s": float(s["max_trajectory_stall_s"]),
        "tests_avg_act_s": float(s["avg_act_by_kind_s"]["tests"]),
        "shell_avg_act_s": float(s["avg_act_by_kind_s"]["shell"]),
        "last_trajectory_end_s": float(s["makespan_s"]),
        "avg_trajectory_end_s": float(s["avg_trajectory_end_s"]),
        "time_shared": float(s["time_shared"]),
        "decision_median_ms": float(s["decision_median_ms"]),
        "decision_p99_ms": float(s["decision_p99_ms"]),
    }
    print(
        f"  {sc.name} {label:<26} avg={out['avg_act_s']:7.3f}s p99={out['p99_act_s']:6.1f}s "
        f"wait={out['max_trajectory_wait_s']:6.1f}s shared={int(out['time_shared']):>6} "
        f"wall={time.perf_counter() - t0:5.1f}s",
        flush=True,
    )
    return out


def saturated_round_ms(rounds: int = 21, share: bool = True) -> float:
    """Median ms of a round on a 256-core node whose cores 16 running actions of 16 cores hold,
    with 1280 queued (the headline round's queue, rigid ones of a kind measured short): the
    round that places the most sharers (`Round.plan`: policy, then sharers)."""
    from paper_decision_time import make_queue

    times = []
    for _ in range(rounds):
        queue = make_queue(1280)
        for a in queue:
            a.kind = "short" if len(a.cost.units.units) == 1 else "long"
        state = ClusterState(cpu={"n0": CpuNode.uniform("n0", 256, 10_000_000, 2)})
        for h in range(16):
            cost = CostVector(ResourceKind.CPU, Elastic.fixed(16), memory_mb=4096)
            holder = QueuedAction(f"h{h}", f"ht{h}", cost, 0.0, t1_s=100.0)
            state.apply(
                Allocation(f"h{h}", ResourceKind.CPU, "n0", 16, tuple(range(16 * h, 16 * h + 16))), holder
            )
        rnd = Round(
            get_policy("tangram-fast", share=share),
            observed=lambda qa, _u: 1.0 if qa.kind == "short" else None,
        )
        waiting = WaitingQueue(queue)
        t0 = time.perf_counter()
        rnd.plan(waiting, state, 1.0)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    runs: dict[str, dict[str, list[float]]] = {label: {} for label in LABELS}
    for nodes, batch in POINTS:
        sc = build("coding", {"batch": batch}, cluster=ClusterSpec(cpu_nodes=nodes))
        for label in LABELS:
            for key, value in one(sc, label).items():
                runs[label].setdefault(key, []).append(value)
    share, excl, pod = runs[SHARE], runs[EXCLUSIVE], runs[POD]
    n = len(POINTS)
    ratios = {
        "share_over_exclusive_avg_act": [share["avg_act_s"][i] / excl["avg_act_s"][i] for i in range(n)],
        "share_over_exclusive_p99_act": [share["p99_act_s"][i] / excl["p99_act_s"][i] for i in range(n)],
        "static_pod_over_share_avg_act": [pod["avg_act_s"][i] / share["avg_act_s"][i] for i in range(n)],
        "static_pod_over_exclusive_avg_act": [pod["avg_act_s"][i] / excl["avg_act_s"][i] for i in range(n)],
        "share_over_dp_avg_act": [share["avg_act_s"][i] / runs[DP]["avg_act_s"][i] for i in range(n)],
    }
    at_5 = POINTS.index((5, 1280))
    targets = {
        "min_speedup_vs_static_pod": min(ratios["static_pod_over_share_avg_act"]),
        "speedup_5_nodes_batch_1280": ratios["static_pod_over_share_avg_act"][at_5],
        "p99_no_worse_than_static_pod_everywhere": all(
            s <= p for s, p in zip(share["p99_act_s"], pod["p99_act_s"], strict=True)
        ),
    }
    rounds = {
        "with_sharing_ms": saturated_round_ms(share=True),
        "without_ms": saturated_round_ms(share=False),
    }
    print(f"targets: {targets}; saturated round: {rounds}")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = [f"{n}x{b}" for n, b in POINTS]
    for label in LABELS:
        a.plot(x, runs[label]["avg_act_s"], marker="o", label=label)
        b.plot(x, runs[label]["p99_act_s"], marker="o", label=label)
    a.set(xlabel="nodes x batch", ylabel="average ACT (s)", yscale="log")
    b.set(xlabel="nodes x batch", ylabel="p99 ACT (s)", yscale="log")
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=60)
    a.legend()
    fig.tight_layout()
    fig.savefig(png("time_share"), dpi=110)
    save(
        "time_share",
        {
            "points": [{"nodes": n, "batch": b} for n, b in POINTS],
            "runs": runs,
            "ratios": ratios,
            "targets": targets,
            "saturated_round": rounds,
        },
    )


if __name__ == "__main__":
    main()
