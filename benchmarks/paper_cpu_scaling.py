"""CPU scaling: coding ACT over batch size (128..1536 on the paper's 15 x 256 cores) and over
core counts (batch 1280 on 5/10/15/20 nodes of 256 cores), tangram vs the static-pod baseline.

The batch sweep also runs the baseline with its pods bin-packed (kube-scheduler's
MostAllocated scoring, `static-pod` with `packing="binpack"`): the default spreading keeps each
node's pods few enough that they hardly contend; packing by the 0.5-core request puts up to 512
pods on a 256-core node. Which of the two the paper's K8s cluster used is not stated.

    .venv/bin/python benchmarks/paper_cpu_scaling.py
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from paper_common import png, ratio, run, save

from scheduler.policies import get_policy
from scheduler.sim import ClusterSpec, build

TANGRAM = ["tangram-fast", "tangram-dp"]
POLICIES = [*TANGRAM, "static-pod"]
BINPACK = "static-pod (binpack)"
BATCHES = [128, 256, 512, 1024, 1536]
NODES = [5, 10, 15, 20]


def main() -> None:
    by_batch: dict[str, list[float]] = {p: [] for p in [*POLICIES, BINPACK]}
    for b in BATCHES:
        sc = build("coding", {"batch": b})
        for p in POLICIES:
            by_batch[p].append(float(run(sc, p)[1]["avg_act_s"]))
        by_batch[BINPACK].append(
            float(run(sc, get_policy("static-pod", packing="binpack"), BINPACK)[1]["avg_act_s"])
        )
    by_nodes: dict[str, list[float]] = {p: [] for p in POLICIES}
    for n in NODES:
        sc = build("coding", {"batch": 1280}, cluster=ClusterSpec(cpu_nodes=n))
        for p in POLICIES:
            by_nodes[p].append(float(run(sc, p)[1]["avg_act_s"]))

    def speedups(acts: dict[str, list[float]], base: str) -> dict[str, list[float]]:
        return {p: [ratio(s, t) for s, t in zip(acts[base], acts[p], strict=True)] for p in TANGRAM}

    speedup_batch = speedups(by_batch, "static-pod")
    speedup_batch_binpack = speedups(by_batch, BINPACK)
    speedup_nodes = speedups(by_nodes, "static-pod")
    print(f"static-pod / tangram over batch {BATCHES}: {speedup_batch}")
    print(f"static-pod (binpack) / tangram over batch {BATCHES}: {speedup_batch_binpack}")
    print(f"static-pod / tangram over nodes {NODES}: {speedup_nodes}")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for p in by_batch:
        a.plot(BATCHES, by_batch[p], marker="o", label=p)
    for p in POLICIES:
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
            "speedup_vs_static_pod_by_batch": speedup_batch,
            "speedup_vs_static_pod_binpack_by_batch": speedup_batch_binpack,
            "nodes": NODES,
            "avg_act_by_nodes_s": by_nodes,
            "speedup_vs_static_pod_by_nodes": speedup_nodes,
        },
    )


if __name__ == "__main__":
    main()
