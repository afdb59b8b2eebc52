"""Evicted reward models through `tangram up`: restored from host memory vs loaded cold, side by side.

    .venv/bin/python benchmarks/reward_tiers_live.py [--calls 24]

Issue 38 as its reporter measured it: the embedded default (configs/local.yaml) with its GPU node
cut to one GPU of 600 MiB, so that `sim` (512 MiB) and `rm` (256 MiB) cannot share it, and the two
called in turn through the Python client, one reward action at a time. Every call after the first
needs the model the previous call evicted. Two fresh deployments: the host tier at its default
budget, and without one (`host_memory_mb: 0`, what main did before). Per call: ACT, the tier the
call's replica came from (`load_tier`) and what that took (`load_s`); the scores must be the same
on every call of a model. CPU-kind Triton instances: a host restore here is a copy between two
host buffers, a cold load a Triton model load. Writes benchmarks/results/reward_tiers_live.json
and reward_tiers_live.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, write_json
from tangram_celery.common.config import default_config_path, load_config
from tangram_celery.deploy import Deployment

INPUTS = {
    "sim": {"reference": "The 30th Fibonacci number is 832040.", "response": "The answer is 832040."},
    "rm": {"prompt": "What is fib(30)?", "response": "The answer is 832040."},
}
GPU_MB = 600  # one GPU: sim (512 MiB) and rm (256 MiB) do not fit together


def run(work: Path, host_memory_mb: int | None, models_dir: Path, calls: int) -> dict[str, Any]:
    """One fresh deployment; `calls` reward actions alternating between the two models."""
    from tangram_celery import RewardAction, TangramClient

    raw = yaml.safe_load(default_config_path().read_text())
    raw["state_dir"] = str(work / "state")
    raw["broker"]["data_dir"] = str(work / "state" / "redis")
    node = {"name": "g0", "num_gpus": 1, "gpu_memory_mb": GPU_MB, "instance_kind": "auto"}
    if host_memory_mb is not None:
        node["host_memory_mb"] = host_memory_mb
    raw["nodes"]["gpu"] = [node]
    for m in raw["reward_models"]:
        if m.get("build"):
            m["path"] = str(models_dir / m["name"])
    path = work / "tangram.yaml"
    path.write_text(yaml.safe_dump(raw))
    dep = Deployment(load_config(path), path, with_flower=False)
    rows: list[dict[str, Any]] = []
    try:
        dep.start(progress=False)
        dep.wait_warm(timeout_s=900)
        first: dict[str, Any] = {}
        with TangramClient(dep.url) as client:
            for i in range(calls):
                model = list(INPUTS)[i % len(INPUTS)]
                r = client.submit(
                    RewardAction(trajectory_id=f"t{i}", model=model, inputs=INPUTS[model])
                ).result(timeout=900)
                if not r.ok:
                    raise SystemExit(f"call {i} ({model}) failed: {r.status} {r.error}")
                if first.setdefault(model, r.output) != r.output:
                    raise SystemExit(f"call {i} ({model}) scored {r.output}, the first call {first[model]}")
                rows.append(
                    {
                        "model": model,
                        "act_s": r.act_s,
                        "exec_s": r.exec_s,
                        "tier": r.load_tier,
                        "load_s": r.load_s,
                    }
                )
                print(f"  {model}: {r.load_tier or '-'} act {r.act_s * 1000:.0f} ms", flush=True)
    finally:
        dep.stop()
    after_first = rows[len(INPUTS) :]  # each model's first call may find it where the warm-up left it
    return {
        "host_memory_mb": "default" if host_memory_mb is None else host_memory_mb,
        "calls": rows,
        "median_act_s": statistics.median(r["act_s"] for r in rows),
        "mean_act_s": statistics.mean(r["act_s"] for r in rows),
        "median_act_s_after_first": statistics.median(r["act_s"] for r in after_first),
        "calls_by_tier": {t: sum(r["tier"] == t for r in rows) for t in ("device", "host", "cold")},
        "median_load_s_by_model": {
            m: statistics.median([r["load_s"] for r in after_first if r["model"] == m] or [0.0])
            for m in INPUTS
        },
    }


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for key, label in (("host_tier", "host tier (default)"), ("no_host_tier", "no host tier")):
        acts = [c["act_s"] * 1000 for c in data[key]["calls"]]
        ax.plot(range(1, len(acts) + 1), acts, marker="o", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("call (sim and rm in turn)")
    ax.set_ylabel("ACT (ms)")
    ax.set_title("One 600 MiB GPU, two models: each call evicts the other")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=24, help="reward actions per deployment (default 24)")
    args = ap.parse_args(argv)
    if args.calls < 4:
        ap.error("--calls must be at least 4")
    with tempfile.TemporaryDirectory(prefix="tangram-reward-tiers-") as tmp:
        work = Path(tmp)
        data: dict[str, Any] = {"gpu_memory_mb": GPU_MB, "calls_per_deployment": args.calls}
        for name, budget in (("host_tier", None), ("no_host_tier", 0)):
            print(f"{name}:", flush=True)
            (work / name).mkdir()
            data[name] = run(work / name, budget, work / "models", args.calls)  # models built once
    data["median_act_ratio_no_tier_over_tier"] = (
        data["no_host_tier"]["median_act_s_after_first"] / data["host_tier"]["median_act_s_after_first"]
    )
    data["load_average_1m_at_end"] = os.getloadavg()[0]
    data["cpus"] = os.cpu_count()
    data["instances"] = (
        "CPU-kind Triton instances: a host restore is a copy between two host buffers, not a host-to-GPU copy"
    )
    write_json("reward_tiers_live", data)
    plot(data, RESULTS / "reward_tiers_live.png")
    for name in ("host_tier", "no_host_tier"):
        d = data[name]
        print(
            f"{name}: median ACT {d['median_act_s_after_first'] * 1000:.0f} ms after each model's first call; "
            f"calls by tier {d['calls_by_tier']}; median restore {d['median_load_s_by_model']}"
        )
    print(f"without the tier the median ACT is {data['median_act_ratio_no_tier_over_tier']:.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
