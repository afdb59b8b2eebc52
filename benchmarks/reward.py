"""Reward servers on a real tritonserver, measured side by side in one run.

    .venv/bin/python benchmarks/reward.py [--quick]

1. Batched vs one-by-one throughput of a small transformer reward model on CPU (batch 32).
2. Restore latency of a cached (resident) service vs a cold one (Triton load on demand).
3. GPU-seconds of evict-on-execution vs one dedicated GPU group per service, 10 declared services
   under skewed (Zipf) load at equal offered load; average ACT reported for each. GPUs are
   declared (CPU-kind instances here): GPU-seconds = GPUs provisioned x wall time.
4. EARL-style DoP profile of the reward model over request-length buckets, and the picks.

Writes benchmarks/results/reward.json and reward.png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, percentile, write_json
from reward_servers.placement import ScalingPolicy
from reward_servers.profile import measure
from reward_servers.service import RewardService
from tangram_celery.config import TangramConfig, parse_config


def config(state: Path, models: list[dict[str, Any]], num_gpus: int, gpu_memory_mb: int) -> TangramConfig:
    node = {"name": "g0", "num_gpus": num_gpus, "gpu_memory_mb": gpu_memory_mb, "instance_kind": "cpu"}
    return parse_config({"state_dir": str(state), "nodes": {"gpu": [node]}, "reward_models": models})


def rows(n: int, rng: random.Random) -> list[dict[str, str]]:
    return [
        {"prompt": f"question {rng.randrange(1000)}", "response": "the answer is yes " * 4} for _ in range(n)
    ]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_batching(state: Path, model_dir: Path, repeats: int) -> dict[str, Any]:
    """Part 1 and 2 (one server): batching ratio and cold vs cached latency."""
    rm = {
        "name": "rm",
        "backend": "hf-seq-cls",
        "path": str(model_dir),
        "max_batch": 32,
        "batch_window_ms": 0,
    }
    cfg = config(state / "batching", [{**rm, "dop_options": [1, 2]}], 2, 4096)
    rng = random.Random(0)
    with RewardService(cfg, monitor_interval_s=None) as svc:
        cold = [timed(lambda c=c: svc.score("rm", rows(1, rng), chunk=c)) for c in ((0,), (1,))]
        cached = [timed(lambda: svc.score("rm", rows(1, rng), chunk=(0,))) for _ in range(10)]
        batch = rows(32, rng)
        batched_s, single_s = [], []
        for _ in range(repeats):  # interleaved so machine noise hits both alike
            batched_s.append(timed(lambda: svc.score("rm", batch, chunk=(0,))))
            single_s.append(timed(lambda: [svc.score("rm", [r], chunk=(0,)) for r in batch]))
        prof = measure(
            "rm",
            lambda b, d: svc.score("rm", b, dop=d),
            [1, 2],
            ["prompt", "response"],
            buckets=(16, 64, 256),
            batch_size=16,
            repeats=2,
        )
    b, s = statistics.median(batched_s), statistics.median(single_s)
    picks = {str(t): prof.pick(t, [1, 2]) for t in (8, 48, 200, 500)}
    return {
        "batching": {
            "batch": 32,
            "batched_req_per_s": 32 / b,
            "one_by_one_req_per_s": 32 / s,
            "speedup": s / b,
            "batched_s": batched_s,
            "one_by_one_s": single_s,
        },
        "restore": {
            "cold_s": cold,
            "cached_median_s": statistics.median(cached),
            "cold_over_cached": statistics.median(cold) / statistics.median(cached),
        },
        "dop_profile": {**prof.to_json(), "picks_by_tokens": picks},
    }


def run_load(
    svc: RewardService, names: list[str], rate_per_s: float, duration_s: float, zipf_s: float, seed: int
) -> list[float]:
    """Open-loop Poisson arrivals, Zipf over services; returns each request's ACT (s)."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** zipf_s for i in range(len(names))]
    acts: list[float] = []
    lock = threading.Lock()

    def one(model: str, arrived: float, batch: list[dict[str, str]]) -> None:
        svc.score(model, batch, dop=1)
        with lock:
            acts.append(time.perf_counter() - arrived)

    with ThreadPoolExecutor(max_workers=8) as pool:
        start = time.perf_counter()
        t = start
        while t - start < duration_s:
            t += rng.expovariate(rate_per_s)
            time.sleep(max(0.0, t - time.perf_counter()))
            model = rng.choices(names, weights)[0]
            pool.submit(one, model, t, rows(rng.randint(1, 4), rng))
    return acts


def bench_gpu_seconds(
    state: Path, model_dir: Path, rate: float, duration_s: float, warmup_s: float, tight: bool
) -> dict[str, Any]:
    """Part 3: dedicated (10 GPUs, everything resident) vs shared 2-GPU nodes with evict-on-execution."""
    names = [f"svc{i}" for i in range(10)]
    models = [{"name": n, "backend": "hf-seq-cls", "path": str(model_dir), "memory_mb": 1024} for n in names]
    setups = {
        # one dedicated GPU per service: all 10 resident for the whole run
        "dedicated": (10, 2, 5 * 1024, True),
        # evict-on-execution on 2 GPUs whose budget holds 5 services each
        "shared_2gpu": (2, 2, 5 * 1024, False),
    }
    if tight:  # budget below the working set: LRU evictions and cold loads under skew
        setups["shared_2gpu_tight"] = (2, 2, 3 * 1024, False)
    out: dict[str, Any] = {}
    for label, (gpus_counted, num_gpus, mem, preload) in setups.items():
        cfg = config(state / label, models, num_gpus, mem)
        with RewardService(cfg, policy=ScalingPolicy(idle_timeout_s=3600), monitor_interval_s=None) as svc:
            t0 = time.perf_counter()
            if preload:
                threads = [threading.Thread(target=svc.manager.preload, args=(n, 1)) for n in names]  # type: ignore[union-attr]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
            run_load(svc, names, rate, warmup_s, 1.2, seed=1)
            setup_s = time.perf_counter() - t0
            before = dict(svc.manager.snapshot()["stats"])  # type: ignore[union-attr]
            t1 = time.perf_counter()
            acts = run_load(svc, names, rate, duration_s, 1.2, seed=2)
            wall = time.perf_counter() - t1
            stats = svc.manager.snapshot()["stats"]  # type: ignore[union-attr]
        out[label] = {
            "gpus": gpus_counted,
            "wall_s": wall,
            "gpu_seconds": gpus_counted * wall,
            "requests": len(acts),
            "avg_act_s": statistics.mean(acts),
            "p99_act_s": percentile(acts, 0.99),
            "loads_measured": stats["loads"] - before["loads"],
            "evictions_measured": stats["evictions"] - before["evictions"],
            "setup_and_warmup_s": setup_s,
        }
    base = out["dedicated"]
    for label in [k for k in out if k != "dedicated"]:
        out[label]["gpu_seconds_vs_dedicated"] = out[label]["gpu_seconds"] / base["gpu_seconds"]
        out[label]["avg_act_vs_dedicated"] = out[label]["avg_act_s"] / base["avg_act_s"]
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    b = data["batching"]
    ax[0].bar(["one-by-one", "batched (32)"], [b["one_by_one_req_per_s"], b["batched_req_per_s"]])
    ax[0].set_title(f"reward model throughput, {b['speedup']:.1f}x")
    ax[0].set_ylabel("requests/s")
    r = data["restore"]
    ax[1].bar(["cached", "cold"], [r["cached_median_s"] * 1000, statistics.median(r["cold_s"]) * 1000])
    ax[1].set_yscale("log")
    ax[1].set_ylabel("first-request latency (ms)")
    ax[1].set_title("restore: cached vs cold service")
    g = data["gpu_seconds"]
    labels = list(g)
    ax[2].bar(labels, [g[k]["gpu_seconds"] for k in labels])
    for i, k in enumerate(labels):
        ax[2].text(i, g[k]["gpu_seconds"], f"ACT {g[k]['avg_act_s'] * 1000:.0f} ms", ha="center", va="bottom")
    ax[2].set_ylabel("GPU-seconds")
    ax[2].set_title("10 services, Zipf load")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter load phases (smoke run)")
    ap.add_argument("--tight", action="store_true", help="also run a memory budget below the working set")
    args = ap.parse_args(argv)
    duration, warmup, rate = (8.0, 6.0, 10.0) if args.quick else (30.0, 15.0, 20.0)
    with tempfile.TemporaryDirectory(prefix="tangram-reward-bench-") as tmp:
        work = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "reward_servers.tiny_models", str(work / "models")],
            check=True,
            capture_output=True,
        )
        model_dir = work / "models" / "seq-cls"
        data = bench_batching(work, model_dir, repeats=3 if args.quick else 5)
        data["gpu_seconds"] = bench_gpu_seconds(work, model_dir, rate, duration, warmup, args.tight)
    data["model"] = "random-init BERT, hidden 64, 2 layers (reward_servers.tiny_models), CPU, 1 torch thread"
    data["load"] = {"rate_per_s": rate, "duration_s": duration, "warmup_s": warmup, "zipf_s": 1.2}
    write_json("reward", data)
    plot(data, RESULTS / "reward.png")
    b, r, g = data["batching"], data["restore"], data["gpu_seconds"]
    print(
        f"batched vs one-by-one at batch 32: {b['speedup']:.1f}x ({b['batched_req_per_s']:.0f} vs {b['one_by_one_req_per_s']:.0f} req/s)"
    )
    print(
        f"restore: cached {r['cached_median_s'] * 1000:.1f} ms, cold {statistics.median(r['cold_s']):.2f} s ({r['cold_over_cached']:.0f}x)"
    )
    for k, v in g.items():
        extra = (
            f", {v['gpu_seconds_vs_dedicated']:.0%} of dedicated GPU-s, ACT x{v['avg_act_vs_dedicated']:.2f}"
            if k != "dedicated"
            else ""
        )
        print(
            f"{k}: {v['gpus']} GPUs, {v['gpu_seconds']:.0f} GPU-s, avg ACT {v['avg_act_s'] * 1000:.0f} ms, p99 {v['p99_act_s'] * 1000:.0f} ms, loads {v['loads_measured']}, evictions {v['evictions_measured']}{extra}"
        )
    print(f"DoP picks by tokens: {data['dop_profile']['picks_by_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
