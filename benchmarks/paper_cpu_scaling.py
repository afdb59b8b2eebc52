"""CPU scaling: coding ACT over batch size (128..1536 on the paper's 15 x 256 cores) and over
core counts (batch 1280 on 5/10/15/20 nodes of 256 cores), tangram vs the static-pod baseline.

`static-pod` runs at a default Kubernetes cluster's settings (docs/simulator.md): pods spread by
kube-scheduler's LeastAllocated score, at most 110 per node (kubelet maxPods), bound at the
scheduler client's 50 QPS, started in a time whose p99 is the 5 s SLO. The sweeps also run the
baseline with its pods bin-packed (MostAllocated scoring, `packing="binpack"`, still at most 110
pods per node): which placement the paper's cluster used is not stated.

    .venv/bin/python benchmarks/paper_cpu_scaling.py
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from paper_common import png, ratio, run, save

from scheduler.sim import ClusterSpec, build

TANGRAM = ["tangram-fast", "tangram-dp"]
POLICIES = [*TANGRAM, "static-pod"]
BINPACK = "static-pod (binpack)"
BATCHES = [128, 256, 512, 1024, 1536]
NODES = [5, 10, 15, 20]


def main() -> None:
    by_batch: dict[str, list[float]] = {p: [] for p in [*POLICIES, BINPACK]}
    p99_batch: dict[str, list[float]] = {p: [] for p in [*POLICIES, BINPACK]}
    wait_batch: dict[str, list[float]] = {p: [] for p in [*POLICIES, BINPACK]}
    for b in BATCHES:
        sc = build("coding", {"batch": b})
        for label, name, params in [
            *((p, p, {}) for p in POLICIES),
            (BINPACK, "static-pod", {"packing": "binpack"}),
        ]:
            s = run(sc, name, label, **params)[1]
            by_batch[label].append(float(s["avg_act_s"]))
            p99_batch[label].append(float(s["p99_act_s"]))
            wait_batch[label].append(float(s["max_trajectory_wait_s"]))
    by_nodes: dict[str, list[float]] = {p: [] for p in [*POLICIES, BINPACK]}
    p99_nodes: dict[str, list[float]] = {p: [] for p in [*POLICIES, BINPACK]}
    wait_nodes: dict[str, list[float]] = {p: [] for p in [*POLICIES, BINPACK]}
    for n in NODES:
        sc = build("coding", {"batch": 1280}, cluster=ClusterSpec(cpu_nodes=n))
        for label, name, params in [
            *((p, p, {}) for p in POLICIES),
            (BINPACK, "static-pod", {"packing": "binpack"}),
        ]:
            s = run(sc, name, label, **params)[1]
            by_nodes[label].append(float(s["avg_act_s"]))
            p99_nodes[label].append(float(s["p99_act_s"]))
            wait_nodes[label].append(float(s["max_trajectory_wait_s"]))

    def speedups(acts: dict[str, list[float]], base: str) -> dict[str, list[float]]:
        return {p: [ratio(s, t) for s, t in zip(acts[base], acts[p], strict=True)] for p in TANGRAM}

    speedup_batch = speedups(by_batch, "static-pod")
    speedup_batch_binpack = speedups(by_batch, BINPACK)
    speedup_nodes = speedups(by_nodes, "static-pod")
    speedup_nodes_binpack = speedups(by_nodes, BINPACK)
    print(f"static-pod / tangram over batch {BATCHES}: {speedup_batch}")
    print(f"static-pod (binpack) / tangram over batch {BATCHES}: {speedup_batch_binpack}")
    print(f"static-pod / tangram over nodes {NODES}: {speedup_nodes}")
    print(f"static-pod (binpack) / tangram over nodes {NODES}: {speedup_nodes_binpack}")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for p in by_batch:
        a.plot(BATCHES, by_batch[p], marker="o", label=p)
        b.plot([n * 256 for n in NODES], by_nodes[p], marker="o", label=p)
    a.set(xlabel="batch size (15 x 256 cores)", ylabel="average ACT (s)")
    b.set(xlabel="CPU cores (batch 1280)", ylabel="average ACT (s)")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(png("paper_cpu_scaling"), dpi=110)
    save(
        "paper_cpu_scaling",
        {
            "batches": BATCHES,
            "avg_act_by_batch_s": by_batch,
            "p99_act_by_batch_s": p99_batch,
            "max_trajectory_wait_by_batch_s": wait_batch,
            "speedup_vs_static_pod_by_batch": speedup_batch,
            "speedup_vs_static_pod_binpack_by_batch": speedup_batch_binpack,
            "nodes": NODES,
            "avg_act_by_nodes_s": by_nodes,
            "p99_act_by_nodes_s": p99_nodes,
            "max_trajectory_wait_by_nodes_s": wait_nodes,
            "speedup_vs_static_pod_by_nodes": speedup_nodes,
            "speedup_vs_static_pod_binpack_by_nodes": speedup_nodes_binpack,
            "targets": targets(by_batch, p99_batch, by_nodes, p99_nodes),
        },
    )


def targets(
    by_batch: dict[str, list[float]],
    p99_batch: dict[str, list[float]],
    by_nodes: dict[str, list[float]],
    p99_nodes: dict[str, list[float]],
) -> dict[str, object]:
    """Issue 18's CPU targets for tangram-fast against static-pod (K8s defaults), per point."""
    fast, pod = "tangram-fast", "static-pod"
    avg = [p / f for f, p in zip(by_batch[fast] + by_nodes[fast], by_batch[pod] + by_nodes[pod], strict=True)]
    p99_ok = all(
        f <= p
        for f, p in zip(p99_batch[fast] + p99_nodes[fast], p99_batch[pod] + p99_nodes[pod], strict=True)
    )
    at_5 = by_nodes[pod][NODES.index(5)] / by_nodes[fast][NODES.index(5)]
    return {
        "min_speedup_vs_static_pod": min(avg),
        "speedup_5_nodes_batch_1280": at_5,
        "p99_no_worse_everywhere": p99_ok,
        "met": min(avg) >= 1.0 and at_5 >= 1.3 and p99_ok,
    }


if __name__ == "__main__":
    main()
