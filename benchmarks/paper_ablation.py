"""Scheduling ablation: elastic DoP 1..32 (tangram) against fixed DoP 4 and 16, coding scenario,
batch 256 and 1280, on 5 and 15 nodes of 256 cores. Reports the reward stage (test suite) ACT.

    .venv/bin/python benchmarks/paper_ablation.py
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from paper_common import png, ratio, run, save

from scheduler.sim import ClusterSpec, build

POLICIES = ["tangram-fast", "tangram-dp", "fixed-dop-4", "fixed-dop-16"]
CASES = [(256, 5), (1280, 5), (256, 15), (1280, 15)]


def main() -> None:
    out: dict[str, dict[str, float]] = {}
    for batch, nodes in CASES:
        sc = build("coding", {"batch": batch}, cluster=ClusterSpec(cpu_nodes=nodes))
        key = f"batch{batch}_nodes{nodes}"
        out[key] = {}
        for p in POLICIES:
            s = run(sc, p)[1]
            out[key][p] = float(s["avg_act_by_kind_s"]["tests"])
            out[key][f"{p}:all"] = float(s["avg_act_s"])
        for base in ("fixed-dop-4", "fixed-dop-16"):
            out[key][f"{base}_over_fast_reward"] = ratio(out[key][base], out[key]["tangram-fast"])
            out[key][f"{base}_over_dp_reward"] = ratio(out[key][base], out[key]["tangram-dp"])
        print(f"  {key}: " + ", ".join(f"{k}={v:.2f}" for k, v in out[key].items()))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    for i, p in enumerate(POLICIES):
        ax.bar([j + i * width for j in range(len(CASES))], [out[k][p] for k in out], width, label=p)
    ax.set_xticks([j + 1.5 * width for j in range(len(CASES))], list(out))
    ax.set(ylabel="reward stage (test suite) average ACT (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png("paper_ablation"), dpi=110)
    save("paper_ablation", out)


if __name__ == "__main__":
    main()
