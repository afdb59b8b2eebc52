"""Resource saving: the smallest GPU count at which tangram serves the 10 MOPD teachers at the
average ACT of the dedicated baseline (one TP4 group per teacher = 40 GPUs).

    .venv/bin/python benchmarks/paper_resource_saving.py
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from paper_common import png, run, save

from scheduler.sim import ClusterSpec, build

GPUS = [4, 6, 8, 10, 12, 16, 24, 32, 40]
DEDICATED_GPUS = 40


def main() -> None:
    base = build("mopd", cluster=ClusterSpec(cpu_nodes=0, gpus_total=DEDICATED_GPUS))
    target = float(run(base, "dedicated-gpu")[1]["avg_act_s"])
    act: dict[str, list[float]] = {"tangram-fast": [], "tangram-dp": []}
    for g in GPUS:
        sc = build("mopd", cluster=ClusterSpec(cpu_nodes=0, gpus_total=g))
        for p in act:
            act[p].append(float(run(sc, p)[1]["avg_act_s"]))
    smallest = {
        p: next((g for g, a in zip(GPUS, v, strict=True) if a <= target), None) for p, v in act.items()
    }
    saved = {p: (1 - g / DEDICATED_GPUS) if g else None for p, g in smallest.items()}
    print(
        f"dedicated ({DEDICATED_GPUS} GPUs) avg ACT {target:.2f} s; smallest GPUs matching it: "
        f"{smallest}; saved: {saved}"
    )
    fig, ax = plt.subplots(figsize=(6, 4))
    for p, v in act.items():
        ax.plot(GPUS, v, marker="o", label=p)
    ax.axhline(target, color="k", ls="--", label=f"dedicated-gpu on {DEDICATED_GPUS} GPUs")
    ax.set(xlabel="GPUs given to tangram", ylabel="average ACT (s)", yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png("paper_resource_saving"), dpi=110)
    save(
        "paper_resource_saving",
        {
            "gpus": GPUS,
            "avg_act_s": act,
            "dedicated_avg_act_s": target,
            "smallest_gpus": smallest,
            "fraction_saved": saved,
        },
    )


if __name__ == "__main__":
    main()
