"""The first reward actions after `tangram up`: warmed at start vs loaded on demand, side by side.

    .venv/bin/python benchmarks/warm_start.py

Two fresh deployments of the embedded default's GPU part (configs/local.yaml: a 2-GPU node
served by CPU-kind Triton instances, the `sim` and `rm` reward models, the `math` rule), one with
`warm_up: true` (the default), one with `warm_up: false`. In each, once `up` has returned (and,
for the warm one, the warm-up has finished, as for a trainer that connects after it), one
reward action per model is submitted at once and its ACT is recorded, with the GPU worker's
count of on-demand loads. Writes benchmarks/results/warm_start.json and warm_start.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import urllib.request
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


def _restores(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("tangram_gpu_restores_total{"):
                return float(line.split()[-1])
    return 0.0


def run(work: Path, warm: bool, models_dir: Path) -> dict[str, Any]:
    """One fresh deployment: ACT of the first action of each model, the on-demand loads."""
    from tangram_celery import RewardAction, TangramClient

    raw = yaml.safe_load(default_config_path().read_text())
    raw["state_dir"] = str(work / "state")
    raw["broker"]["data_dir"] = str(work / "state" / "redis")
    raw["nodes"]["gpu"][0]["warm_up"] = warm
    for m in raw["reward_models"]:
        if m.get("build"):
            m["path"] = str(models_dir / m["name"])
    path = work / "tangram.yaml"
    path.write_text(yaml.safe_dump(raw))
    dep = Deployment(load_config(path), path, with_flower=False)
    try:
        t0 = time.monotonic()
        dep.start(progress=False)
        up_s = time.monotonic() - t0
        warm_s = 0.0
        if warm:
            t1 = time.monotonic()
            dep.wait_warm(timeout_s=900)
            warm_s = time.monotonic() - t1
        with TangramClient(dep.url) as client:
            handles = {
                m: client.submit(RewardAction(trajectory_id=f"first-{m}", model=m, inputs=i))
                for m, i in INPUTS.items()
            }
            results = {m: h.result(timeout=900) for m, h in handles.items()}
        restores = _restores(dep.metrics_ports["worker-gpu-g0"])
    finally:
        dep.stop()
    bad = {m: r.error for m, r in results.items() if not r.ok}
    if bad:
        raise SystemExit(f"reward actions failed: {bad}")
    return {
        "warm_up": warm,
        "up_s": up_s,
        "waited_for_warm_up_s": warm_s,
        "first_act_s": {m: r.act_s for m, r in results.items()},
        "first_exec_s": {m: r.exec_s for m, r in results.items()},
        "on_demand_loads": restores,
    }


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    models = list(INPUTS)
    for k, (label, run_) in enumerate((("warmed at start", data["warm"]), ("on demand", data["cold"]))):
        xs = [i + k * 0.38 for i in range(len(models))]
        ax.bar(xs, [run_["first_act_s"][m] for m in models], width=0.36, label=label)
    ax.set_xticks([i + 0.19 for i in range(len(models))], [f"first {m} action" for m in models])
    ax.set_ylabel("ACT (s)")
    ax.set_yscale("log")
    ax.set_title("First reward action after `tangram up`")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tangram-warm-start-") as tmp:
        work = Path(tmp)
        data: dict[str, Any] = {}
        for name, warm in (("warm", True), ("cold", False)):
            (work / name).mkdir()
            data[name] = run(work / name, warm, work / "models")  # the model is built once, by the first
    data["act_ratio_cold_over_warm"] = {
        m: data["cold"]["first_act_s"][m] / max(data["warm"]["first_act_s"][m], 1e-9) for m in INPUTS
    }
    data["load_average_1m_at_end"] = os.getloadavg()[0]
    data["cpus"] = os.cpu_count()
    write_json("warm_start", data)
    plot(data, RESULTS / "warm_start.png")
    for m in INPUTS:
        print(
            f"first {m} action: warm {data['warm']['first_act_s'][m] * 1000:.0f} ms, "
            f"on demand {data['cold']['first_act_s'][m]:.2f} s ({data['act_ratio_cold_over_warm'][m]:.0f}x); "
            f"on-demand loads: warm {data['warm']['on_demand_loads']:.0f}, cold {data['cold']['on_demand_loads']:.0f}"
        )
    print(
        f"warm-up took {data['warm']['waited_for_warm_up_s']:.1f} s after `up` returned (in the background)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
