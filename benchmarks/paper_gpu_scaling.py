"""GPU scaling: MOPD ACT over batch size on 5 x 8 GPUs: tangram vs dedicated GPU groups per
teacher (SGLang-like) vs load-on-demand (ServerlessLLM-like).

Each baseline runs in the paper's configuration (one TP4 group per teacher serving one call at
a time; a load from storage for every call) and in its strongest configuration at each batch
size: the lowest average ACT over what an operator can configure (dedicated: TP size, replicas
sized by load, concurrent calls per group; cold-start: keep-alive window, checkpoints in host
memory or on storage; `paper_common.DEDICATED_GRID` / `COLD_START_GRID`).

Tangram runs with the three GPU tiers of issue 38 (`scheduler.gpu_cache`): its `tangram-*`
lines have 2 TiB of host memory per 8-GPU node (a DGX H100/H200), the "(host 1 TiB)" lines a
tight budget, the "(host unlimited)" lines the paper's assumption (every service backed up in
host memory, every miss a host restore). `loads_by_tier` counts device hits, host restores
and cold loads per run. The baselines do not use the host tier (docs/simulator.md).

    .venv/bin/python benchmarks/paper_gpu_scaling.py
"""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from paper_common import COLD_START_GRID, DEDICATED_GRID, png, ratio, run, save, strongest

from scheduler.sim import ClusterSpec, build

TANGRAM = ["tangram-fast", "tangram-dp"]
# label suffix -> host memory per GPU node (MiB): a DGX H100/H200's 2 TB, a tight 1 TiB that
# holds the GPUs' 640 GB of instances with little to spare, and the paper's unlimited
HOST_BUDGETS: dict[str, int | None] = {"": 2_097_152, " (host 1 TiB)": 1_048_576, " (host unlimited)": None}
BASELINES = {"dedicated-gpu": DEDICATED_GRID, "cold-start": COLD_START_GRID}
BATCHES = [64, 256, 512, 1024, 2048]


def main() -> None:
    hosted = {f"{p}{suffix}": (p, mb) for suffix, mb in HOST_BUDGETS.items() for p in TANGRAM}
    labels = [*hosted, *BASELINES, *(f"{b} (strongest)" for b in BASELINES)]
    act: dict[str, list[float]] = {p: [] for p in labels}
    restores: dict[str, list[int]] = {p: [] for p in labels}
    tiers: dict[str, list[dict[str, int]]] = {p: [] for p in labels}
    configs: dict[str, list[dict[str, Any]]] = {b: [] for b in BASELINES}
    for batch in BATCHES:
        sc = build("mopd", {"batch": batch})
        runs = [(label, p, mb) for label, (p, mb) in hosted.items()] + [(b, b, None) for b in BASELINES]
        for label, p, mb in runs:
            on = build(
                "mopd", {"batch": batch}, cluster=ClusterSpec(cpu_nodes=0, gpus_total=40, host_memory_mb=mb)
            )
            _, s = run(on, p, label)
            act[label].append(float(s["avg_act_s"]))
            restores[label].append(int(s["restores"]) + int(s["cold_loads"]))
            tiers[label].append(s["loads_by_tier"])
        for base, grid in BASELINES.items():
            params, _, tried = strongest(sc, base, grid)
            configs[base].append({"params": params, "tried_avg_act_s": tried})
            label = f"{base} (strongest)"
            _, s = run(sc, base, label, **params)
            act[label].append(float(s["avg_act_s"]))
            restores[label].append(int(s["restores"]) + int(s["cold_loads"]))
            tiers[label].append(s["loads_by_tier"])
    vs = {
        base: [ratio(x, y) for x, y in zip(act[base], act["tangram-fast"], strict=True)]
        for base in labels
        if base != "tangram-fast"
    }
    print(f"baseline / tangram-fast over batch {BATCHES}: {vs}")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in labels:
        name = f"{p} (host 2 TiB)" if p in TANGRAM else p
        ax.plot(
            BATCHES,
            act[p],
            marker="o",
            label=name,
            ls="--" if "strongest" in p else ":" if "host" in p else "-",
        )
    ax.set(xlabel="batch size (MOPD, 10 teachers, 40 GPUs)", ylabel="average ACT (s)", yscale="log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png("paper_gpu_scaling"), dpi=110)
    save(
        "paper_gpu_scaling",
        {
            "batches": BATCHES,
            "avg_act_s": act,
            "restores_or_loads": restores,
            "loads_by_tier": tiers,
            "host_memory_mb": {label: mb for label, (_, mb) in hosted.items()},
            "baseline_over_fast": vs,
            "strongest": configs,
        },
    )


if __name__ == "__main__":
    main()
