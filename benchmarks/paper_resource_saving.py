"""Resource saving: the fewest GPUs at which tangram serves the 10 MOPD teachers at a dedicated
deployment's average ACT, against the dedicated baseline in two configurations.

- The paper's configuration: one TP4 group per teacher serving one call at a time, on 40 GPUs.
  Saved = 1 - tangram's GPUs / 40 (the paper's framing).
- The strongest configuration at every GPU count: TP size, replicas sized by load and concurrent
  calls per group chosen for the lowest average ACT (`paper_common.DEDICATED_GRID`). Both sides
  may then shrink: for a target ACT, each needs the fewest GPUs of the grid whose ACT meets it,
  and saved = 1 - tangram's GPUs / dedicated's GPUs. Targets: the strongest dedicated ACT on 40
  GPUs, and the paper configuration's ACT on 40 GPUs. "None" means not reached within 40 GPUs.

Tangram runs with the three GPU tiers of issue 38, at the host budgets of
`paper_gpu_scaling.HOST_BUDGETS`: its `tangram-*` figures with 2 TiB of host memory per 8-GPU
node, the "(host 1 TiB)" and "(host unlimited)" ones beside them; `loads_by_tier` counts device
hits, host restores and cold loads per run.

    .venv/bin/python benchmarks/paper_resource_saving.py
"""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from paper_common import DEDICATED_GRID, png, run, save, strongest
from paper_gpu_scaling import HOST_BUDGETS

from scheduler.sim import ClusterSpec, build

GPUS = [4, 6, 8, 10, 12, 16, 20, 24, 32, 40]
DEDICATED_GPUS = 40
TANGRAM = ["tangram-fast", "tangram-dp"]
STRONGEST = "dedicated-gpu (strongest)"


def fewest(acts: list[float], target: float) -> int | None:
    """The fewest GPUs of the grid whose ACT meets `target` (ACT falls with GPUs)."""
    return next((g for g, a in zip(GPUS, acts, strict=True) if a <= target), None)


def main() -> None:
    base = build("mopd", cluster=ClusterSpec(cpu_nodes=0, gpus_total=DEDICATED_GPUS))
    paper_target = float(run(base, "dedicated-gpu")[1]["avg_act_s"])
    hosted = {f"{p}{suffix}": (p, mb) for suffix, mb in HOST_BUDGETS.items() for p in TANGRAM}
    act: dict[str, list[float]] = {p: [] for p in [*hosted, STRONGEST]}
    tiers: dict[str, list[dict[str, int]]] = {p: [] for p in hosted}
    configs: list[dict[str, Any]] = []
    for g in GPUS:
        sc = build("mopd", cluster=ClusterSpec(cpu_nodes=0, gpus_total=g))
        for label, (p, mb) in hosted.items():
            on = build("mopd", cluster=ClusterSpec(cpu_nodes=0, gpus_total=g, host_memory_mb=mb))
            s = run(on, p, label)[1]
            act[label].append(float(s["avg_act_s"]))
            tiers[label].append(s["loads_by_tier"])
        params, best, tried = strongest(sc, "dedicated-gpu", DEDICATED_GRID)
        configs.append({"gpus": g, "params": params, "tried_avg_act_s": tried})
        act[STRONGEST].append(best)
        print(f"  {g} GPUs: strongest dedicated {params} avg_act={best:.3f}s", flush=True)
    strong_target = act[STRONGEST][-1]
    paper = {p: fewest(act[p], paper_target) for p in hosted}
    saved = {p: (1 - g / DEDICATED_GPUS) if g else None for p, g in paper.items()}
    vs_strongest: dict[str, dict[str, Any]] = {}
    for name, target in (("strongest_on_40", strong_target), ("paper_on_40", paper_target)):
        ded = fewest(act[STRONGEST], target)
        row: dict[str, Any] = {"target_avg_act_s": target, "dedicated_gpus": ded}
        for p in hosted:
            g = fewest(act[p], target)
            row[f"{p}_gpus"] = g
            row[f"{p}_saved"] = (1 - g / ded) if g and ded else None
        vs_strongest[name] = row
    print(
        f"paper config ({DEDICATED_GPUS} GPUs) avg ACT {paper_target:.2f} s: fewest GPUs {paper}, saved {saved}"
    )
    print(f"against the strongest dedicated configuration: {vs_strongest}")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for p, v in act.items():
        name = f"{p} (host 2 TiB)" if p in TANGRAM else p
        ax.plot(GPUS, v, marker="o", label=name, ls=":" if "host" in p else "-")
    ax.axhline(paper_target, color="k", ls="--", label=f"dedicated-gpu, paper config, {DEDICATED_GPUS} GPUs")
    ax.set(xlabel="GPUs", ylabel="average ACT (s)", yscale="log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png("paper_resource_saving"), dpi=110)
    save(
        "paper_resource_saving",
        {
            "gpus": GPUS,
            "avg_act_s": act,
            "dedicated_avg_act_s": paper_target,
            "smallest_gpus": paper,
            "fraction_saved": saved,
            "vs_strongest": vs_strongest,
            "loads_by_tier": tiers,
            "host_memory_mb": {label: mb for label, (_, mb) in hosted.items()},
            "strongest_by_gpus": configs,
        },
    )


if __name__ == "__main__":
    main()
