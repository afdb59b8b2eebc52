"""CPU scaling: coding ACT over batch size (128..1536 on the paper's 15 x 256 cores) and over core counts
(batch 1280 on 5/10/15/20 nodes of 256 cores), tangram vs the static-pod baseline.

    .venv/bin/python benchmarks/paper_cpu_scaling.py
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from paper_common import png, ratio, run, save

from scheduler.sim import ClusterSpec, build

POLICIES = ["tangram-fast", "tangram-dp", "static-pod"]
BATCHES = [128, 256, 512, 1024, 1536]
NODES = [5, 10, 15, 20]


def main() -> None:
    by_batch: dict[str, list[float]] = {p: [] for p in POLICIES}
    for b in BATCHES:
        sc = build("coding", {"batch": b})
        for p in POLICIES:
            by_batch[p].append(float(run(sc, p)[1]["avg_act_s"]))
    by_nodes: dict[str, list[float]] = {p: [] for p in POLICIES}
    for n in NODES:
        sc = build("coding", {"batch": 1280}, cluster=ClusterSpec(cpu_nodes=n))
        for p in POLICIES:
            by_nodes[p].append(float(run(sc, p)[1]["avg_act_s"]))
    speedup_batch = {
        p: [ratio(s, t) for s, t in zip(by_batch["static-pod"], by_batch[p], strict=True)]
        for p in ("tangram-fast", "tangram-dp")
    }
    speedup_nodes = {
        p: [ratio(s, t) for s, t in zip(by_nodes["static-pod"], by_nodes[p], strict=True)]
        for p in ("tangram-fast", "tangram-dp")
    }
    print(f"static-pod / tangram over batch {BATCHES}: {speedup_batch}")
    print(f"static-pod / tangram over nodes {NODES}: {speedup_nodes}")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for p in POLICIES:
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
            "speedup_vs_static_pod_by_batch": speedup_batch,
            "nodes": NODES,
            "avg_act_by_nodes_s": by_nodes,
            "speedup_vs_static_pod_by_nodes": speedup_nodes,
        },
    )


if __name__ == "__main__":
    main()
