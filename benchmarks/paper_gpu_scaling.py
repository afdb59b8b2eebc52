"""GPU scaling: MOPD ACT over batch size on 5 x 8 GPUs: tangram vs one dedicated TP4 group per
teacher (SGLang-like) vs load-on-demand without cache (ServerlessLLM-like).

    .venv/bin/python benchmarks/paper_gpu_scaling.py
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from paper_common import png, ratio, run, save

from scheduler.sim import build

POLICIES = ["tangram-fast", "tangram-dp", "dedicated-gpu", "cold-start"]
BATCHES = [64, 256, 512, 1024, 2048]


def main() -> None:
    act: dict[str, list[float]] = {p: [] for p in POLICIES}
    restores: dict[str, list[int]] = {p: [] for p in POLICIES}
    for b in BATCHES:
        sc = build("mopd", {"batch": b})
        for p in POLICIES:
            _, s = run(sc, p)
            act[p].append(float(s["avg_act_s"]))
            restores[p].append(int(s["restores"]))
    vs = {
        base: [ratio(x, y) for x, y in zip(act[base], act["tangram-fast"], strict=True)]
        for base in ("dedicated-gpu", "cold-start", "tangram-dp")
    }
    print(f"baseline / tangram-fast over batch {BATCHES}: {vs}")
    fig, ax = plt.subplots(figsize=(6, 4))
    for p in POLICIES:
        ax.plot(BATCHES, act[p], marker="o", label=p)
    ax.set(xlabel="batch size (MOPD, 10 teachers, 40 GPUs)", ylabel="average ACT (s)", yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png("paper_gpu_scaling"), dpi=110)
    save(
        "paper_gpu_scaling",
        {"batches": BATCHES, "avg_act_s": act, "restores": restores, "baseline_over_fast": vs},
    )


if __name__ == "__main__":
    main()
