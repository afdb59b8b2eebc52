"""GPU scaling: MOPD ACT over batch size on 5 x 8 GPUs: tangram vs dedicated GPU groups per
teacher (SGLang-like) vs load-on-demand (ServerlessLLM-like).

Each baseline runs in the paper's configuration (one TP4 group per teacher serving one call at
a time; a load from storage for every call) and in its strongest configuration at each batch
size: the lowest average ACT over what an operator can configure (dedicated: TP size, replicas
sized by load, concurrent calls per group; cold-start: keep-alive window, checkpoints in host
memory or on storage; `paper_common.DEDICATED_GRID` / `COLD_START_GRID`).

    .venv/bin/python benchmarks/paper_gpu_scaling.py
"""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from paper_common import COLD_START_GRID, DEDICATED_GRID, png, ratio, run, save, strongest

from scheduler.sim import build

TANGRAM = ["tangram-fast", "tangram-dp"]
BASELINES = {"dedicated-gpu": DEDICATED_GRID, "cold-start": COLD_START_GRID}
BATCHES = [64, 256, 512, 1024, 2048]


def main() -> None:
    labels = [*TANGRAM, *BASELINES, *(f"{b} (strongest)" for b in BASELINES)]
    act: dict[str, list[float]] = {p: [] for p in labels}
    restores: dict[str, list[int]] = {p: [] for p in labels}
    configs: dict[str, list[dict[str, Any]]] = {b: [] for b in BASELINES}
    for batch in BATCHES:
        sc = build("mopd", {"batch": batch})
        for p in [*TANGRAM, *BASELINES]:
            _, s = run(sc, p)
            act[p].append(float(s["avg_act_s"]))
            restores[p].append(int(s["restores"]) + int(s["cold_loads"]))
        for base, grid in BASELINES.items():
            params, _, tried = strongest(sc, base, grid)
            configs[base].append({"params": params, "tried_avg_act_s": tried})
            label = f"{base} (strongest)"
            _, s = run(sc, base, label, **params)
            act[label].append(float(s["avg_act_s"]))
            restores[label].append(int(s["restores"]) + int(s["cold_loads"]))
    vs = {
        base: [ratio(x, y) for x, y in zip(act[base], act["tangram-fast"], strict=True)]
        for base in labels
        if base != "tangram-fast"
    }
    print(f"baseline / tangram-fast over batch {BATCHES}: {vs}")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in labels:
        ax.plot(BATCHES, act[p], marker="o", label=p, ls="--" if "strongest" in p else "-")
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
            "baseline_over_fast": vs,
            "strongest": configs,
        },
    )


if __name__ == "__main__":
    main()
