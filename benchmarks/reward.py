"""Reward servers on a real tritonserver, measured side by side in one run.

    .venv/bin/python benchmarks/reward.py [--quick] [--no-cold] [--rate 4] [--zipf 1.2] [--shared-slots 8]

1. Batched vs one-by-one throughput of a small transformer reward model (batch 32).
2. First-call latency of a cached (resident) service, of one restored from host memory (issue
   38's host tier: evicted to host, then called), and of a cold one (Triton load on demand).
3. Dedicated vs shared, 10 services under skewed (Zipf) open-loop load, the same arrivals for
   both: "dedicated" runs one model instance per service, each on its own declared GPU (an 8-GPU
   and a 2-GPU node, one tritonserver each), all resident from the start; "shared" runs evict on
   execution on 2 declared GPUs whose memory budget holds fewer services (8 by default) than the
   working set (10), so restores and evictions happen inside the measured window: with the host
   tier holding the 10 services ("shared": an evicted service stays in host memory and comes back
   by a copy) and without one ("shared_no_host_tier": every miss is a cold load; leave it out
   with --no-cold). Both shared setups warm up as the GPU worker does at start. Charged for all,
   measured over the window (first arrival to last completion): GPU-seconds (GPUs declared x
   wall), resident instance-seconds (replicas loaded or loading, integrated over the window) and
   busy instance-seconds (inference, plus loading for the shared setup). ACT per request.
4. EARL-style DoP profile of the reward model over request-length buckets, and the picks.

The instances are CPU-kind (KIND_CPU): there is no GPU on this machine, every setup computes on
the same CPU cores, a cold load is a Triton model load (a Python stub that imports torch,
seconds), and a host-tier restore is a copy between two host buffers, not a host-to-GPU copy.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, percentile, write_json
from reward_servers.placement import ScalingPolicy
from reward_servers.profile import measure
from reward_servers.service import RewardService, Traced
from scheduler.gpu_cache import Tier
from tangram_celery.common.config import TangramConfig, parse_config

INSTANCES_NOTE = (
    "instances are CPU-kind (Triton KIND_CPU) on this machine's CPU cores: the GPUs are declared, "
    "not real; a cold load is a Triton model load (a Python stub importing torch), and a host-tier "
    "restore is a memory copy between two host buffers (the weights' host copy into a fresh "
    "buffer standing in for device memory), not a host-to-GPU copy"
)


# The shared setup's host tier holds the working set: 10 services x (1024 MiB declared + the
# default 512 MiB per process). The tiny models weigh a few MB: the budget is what is declared.
HOST_BUDGET_MB = 16384


def config(
    state: Path,
    models: list[dict[str, Any]],
    num_gpus: int,
    gpu_memory_mb: int,
    host_memory_mb: int | None = None,
) -> TangramConfig:
    node = {
        "name": "g0",
        "num_gpus": num_gpus,
        "gpu_memory_mb": gpu_memory_mb,
        "instance_kind": "cpu",
        "host_memory_mb": host_memory_mb,
    }
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
        host = []  # evicted to host memory, then called: the call restores it
        for _ in range(10):
            assert svc.manager is not None and svc.manager.retire("rm__dop1__g0")
            host.append(timed(lambda: svc.score("rm", rows(1, rng), chunk=(0,))))
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
            # first call after an eviction to host memory (restore + the call itself)
            "host_s": host,
            "host_median_s": statistics.median(host),
            "cold_over_host": statistics.median(cold) / statistics.median(host),
        },
        "dop_profile": {**prof.to_json(), "picks_by_tokens": picks},
    }


@dataclass
class Setup:
    """One way of serving the 10 services: its reward services (one tritonserver each), the GPUs
    it declares, and which (service, chunk) calls go to (None: the manager places them)."""

    label: str
    services: list[RewardService]
    gpus: int
    route: dict[str, tuple[int, tuple[int, ...] | None]]  # model -> (service index, chunk)

    def score(self, model: str, batch: list[dict[str, str]]) -> Traced:
        """Score one request: the seconds of inference (no load, no wait), and the tier its
        replica came from with the seconds that took."""
        i, chunk = self.route[model]
        return self.services[i].score_traced(model, batch, chunk=chunk, dop=None if chunk else 1)

    def stats(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for svc in self.services:
            for k, v in svc.manager.snapshot()["stats"].items():  # type: ignore[union-attr]
                total[k] = total.get(k, 0) + v
        return total

    def resident(self, states: tuple[str, ...] = ("ready", "loading", "restoring")) -> int:
        """Replicas in `states` now (default: on the device), over every server."""
        return sum(
            1
            for svc in self.services
            for r in svc.manager.snapshot()["replicas"]  # type: ignore[union-attr]
            if r["state"] in states
        )


def run_load(
    setup: Setup, names: list[str], rate_per_s: float, duration_s: float, zipf_s: float, seed: int
) -> dict[str, Any]:
    """Open-loop Poisson arrivals for `duration_s`, Zipf over services, waited to the last
    completion. Returns each request's ACT and inference seconds, the wall time from the first
    arrival to the last completion, and the resident instance-seconds integrated over it."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** zipf_s for i in range(len(names))]
    acts: list[float] = []
    exec_s: list[float] = []
    paid: dict[str, list[float]] = {str(t): [] for t in Tier}  # tier -> each call's restore seconds
    failures: list[str] = []
    lock = threading.Lock()
    done = threading.Event()
    resident = {"instance_s": 0.0, "max": 0, "host_instance_s": 0.0}

    def sample() -> None:  # integrate the number of resident replicas over the window
        last = time.perf_counter()
        while not done.wait(0.05):
            now, n = time.perf_counter(), setup.resident()
            resident["instance_s"] += n * (now - last)
            resident["host_instance_s"] += setup.resident(("host", "offloading")) * (now - last)
            resident["max"] = max(resident["max"], n)
            last = now
        resident["instance_s"] += setup.resident() * (time.perf_counter() - last)

    def one(model: str, arrived: float, batch: list[dict[str, str]]) -> None:
        try:
            traced = setup.score(model, batch)
        except Exception as e:  # counted, not hidden: a failed request is a result
            with lock:
                failures.append(f"{model}: {e}")
            return
        with lock:
            acts.append(time.perf_counter() - arrived)
            exec_s.append(traced.exec_s)
            paid[str(traced.tier)].append(traced.load_s)

    sampler = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    sampler.start()
    with ThreadPoolExecutor(max_workers=8) as pool:
        t = start
        while t - start < duration_s:
            t += rng.expovariate(rate_per_s)
            time.sleep(max(0.0, t - time.perf_counter()))
            model = rng.choices(names, weights)[0]
            pool.submit(one, model, t, rows(rng.randint(1, 4), rng))
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    return {
        "acts": acts,
        "exec_s": exec_s,
        "failures": failures,
        "wall_s": wall,
        "resident_instance_s": resident["instance_s"],
        "host_instance_s": resident["host_instance_s"],
        "max_resident": resident["max"],
        "paid": paid,
    }


def _setups(
    state: Path, model_dir: Path, names: list[str], shared_slots: int, with_cold: bool
) -> list[tuple[str, Any]]:
    """(label, factory) for the dedicated and the shared deployments."""
    models = [{"name": n, "backend": "hf-seq-cls", "path": str(model_dir), "memory_mb": 1024} for n in names]

    def dedicated() -> Setup:
        # one instance per service, each on its own declared GPU (1 GiB budget: only it fits):
        # an 8-GPU node and a 2-GPU node, one tritonserver each
        sizes = [8, 2]
        services, route, first = [], {}, 0
        for k, size in enumerate(sizes):
            part = names[first : first + size]
            cfg = config(state / f"dedicated{k}", [m for m in models if m["name"] in part], size, 1024)
            services.append(
                RewardService(cfg, policy=ScalingPolicy(idle_timeout_s=3600), monitor_interval_s=None)
            )
            route |= {n: (k, (g,)) for g, n in enumerate(part)}
            first += size
        return Setup("dedicated", services, sum(sizes), route)

    def shared(host_memory_mb: int | None) -> Callable[[], Setup]:
        # evict on execution: 2 GPUs whose budget holds `shared_slots` of the 10 services, with
        # a host tier that holds all 10 (HOST_BUDGET_MB) or without one (0)
        def make() -> Setup:
            per_gpu = shared_slots // 2
            label = "shared" if host_memory_mb is None else "shared_no_host_tier"
            budget = HOST_BUDGET_MB if host_memory_mb is None else host_memory_mb
            cfg = config(state / label, models, 2, per_gpu * 1024, budget)
            svc = RewardService(cfg, policy=ScalingPolicy(idle_timeout_s=3600), monitor_interval_s=None)
            return Setup(label, [svc], 2, {n: (0, None) for n in names})

        return make

    out: list[tuple[str, Any]] = [("dedicated", dedicated), ("shared", shared(None))]
    return [*out, ("shared_no_host_tier", shared(0))] if with_cold else out


def bench_dedicated_vs_shared(
    state: Path,
    model_dir: Path,
    rate: float,
    duration_s: float,
    warmup_s: float,
    zipf_s: float,
    shared_slots: int,
    with_cold: bool = True,
) -> dict[str, Any]:
    """Part 3: one instance per service (dedicated) vs evict-on-execution on 2 GPUs whose memory
    holds fewer services than the working set, at equal offered load, measured side by side:
    with the host tier, and (`with_cold`) without it."""
    names = [f"svc{i}" for i in range(10)]
    out: dict[str, Any] = {}
    for label, factory in _setups(state, model_dir, names, shared_slots, with_cold):
        setup = factory()
        for svc in setup.services:
            svc.start()
        try:
            t0 = time.perf_counter()
            if label == "dedicated":  # every instance resident before any request
                threads = [
                    threading.Thread(target=setup.services[i].manager.preload, args=(n, 1, chunk))  # type: ignore[union-attr]
                    for n, (i, chunk) in setup.route.items()
                ]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
            else:  # what the GPU worker does at start: the host tier first, then the GPUs
                setup.services[0].warm_up()
            warm = run_load(setup, names, rate, warmup_s, zipf_s, seed=1)
            setup_s = time.perf_counter() - t0
            before = setup.stats()
            run = run_load(setup, names, rate, duration_s, zipf_s, seed=2)
            after = setup.stats()
        finally:
            for svc in setup.services:
                svc.stop()
        acts, busy = run["acts"], run["exec_s"]
        load_s = after["load_s"] - before["load_s"]
        out[label] = {
            "declared_gpus": setup.gpus,
            "servers": len(setup.services),
            "requests": len(acts),
            "failed_requests": len(run["failures"]),
            "failures": run["failures"][:5],
            "wall_s": run["wall_s"],
            "avg_act_s": statistics.mean(acts) if acts else None,
            "p99_act_s": percentile(acts, 0.99) if acts else None,
            "loads_measured": int(after["loads"] - before["loads"]),
            "host_restores_measured": int(after["host_restores"] - before["host_restores"]),
            "offloads_measured": int(after["offloads"] - before["offloads"]),
            "drops_measured": int(after["drops"] - before["drops"]),
            "calls_by_tier": {t: len(v) for t, v in run["paid"].items()},
            "host_restore_p50_s": _median(run["paid"]["host"]),
            "host_restore_p99_s": percentile(run["paid"]["host"], 0.99) if run["paid"]["host"] else None,
            "cold_load_p50_s": _median(run["paid"]["cold"]),
            "evictions_measured": int(after["evictions"] - before["evictions"]),
            "load_s_measured": load_s,
            "inference_s": sum(busy),
            # what is charged: GPUs held for the wall time; instances resident over it; and the
            # seconds an instance was busy (inference, plus loading for the shared setup)
            "gpu_seconds": setup.gpus * run["wall_s"],
            "resident_instance_seconds": run["resident_instance_s"],
            "host_instance_seconds": run["host_instance_s"],
            "max_resident_instances": run["max_resident"],
            "busy_instance_seconds": sum(busy) + load_s,
            "setup_and_warmup_s": setup_s,
            "warmup_loads": int(before["loads"] + before["warm_loads"]),
            "warmup_failed_requests": len(warm["failures"]),
        }
    base = out["dedicated"]
    for label, sh in out.items():
        if label == "dedicated":
            continue
        for key in (
            "gpu_seconds",
            "resident_instance_seconds",
            "busy_instance_seconds",
            "avg_act_s",
            "p99_act_s",
        ):
            if base[key] and sh[key] is not None:
                sh[f"{key}_vs_dedicated"] = sh[key] / base[key]
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    b = data["batching"]
    ax[0].bar(["one-by-one", "batched (32)"], [b["one_by_one_req_per_s"], b["batched_req_per_s"]])
    ax[0].set_title(f"reward model throughput, {b['speedup']:.1f}x")
    ax[0].set_ylabel("requests/s")
    r = data["restore"]
    ax[1].bar(
        ["cached", "host memory", "cold"],
        [r["cached_median_s"] * 1000, r["host_median_s"] * 1000, statistics.median(r["cold_s"]) * 1000],
    )
    ax[1].set_yscale("log")
    ax[1].set_ylabel("first-request latency (ms)")
    ax[1].set_title("first call: cached, restored from host, cold")
    g = data["dedicated_vs_shared"]
    labels = list(g)
    keys = ["gpu_seconds", "resident_instance_seconds", "busy_instance_seconds"]
    width = 0.25
    for j, key in enumerate(keys):
        ax[2].bar([i + j * width for i in range(len(labels))], [g[k][key] for k in labels], width, label=key)
    ax[2].set_xticks([i + width for i in range(len(labels))], labels)
    ax[2].set_ylabel("seconds charged (CPU-kind instances)")
    ax[2].legend(fontsize=7)
    ax[2].set_title("10 services, Zipf load: what each setup holds")
    ax[3].bar(labels, [1000 * (g[k]["avg_act_s"] or 0) for k in labels])
    for i, k in enumerate(labels):
        ax[3].text(
            i,
            1000 * (g[k]["avg_act_s"] or 0),
            f"cold {g[k]['loads_measured']}, host {g[k]['host_restores_measured']}",
            ha="center",
            va="bottom",
        )
    ax[3].set_yscale("log")
    ax[3].set_ylabel("average ACT (ms)")
    ax[3].set_title("ACT, loads in the measured window")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter load phases (smoke run)")
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    ap.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the services' popularity")
    ap.add_argument(
        "--no-cold", action="store_true", help="leave out the shared setup without a host tier (faster)"
    )
    ap.add_argument(
        "--shared-slots",
        type=int,
        default=8,
        help="services the shared setup's 2 GPUs hold at once (even; below 10 = the working set)",
    )
    args = ap.parse_args(argv)
    if args.shared_slots < 2 or args.shared_slots % 2:
        ap.error("--shared-slots must be an even number >= 2")
    duration, warmup = (20.0, 10.0) if args.quick else (60.0, 20.0)
    with tempfile.TemporaryDirectory(prefix="tangram-reward-bench-") as tmp:
        work = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "reward_servers.tiny_models", str(work / "models")],
            check=True,
            capture_output=True,
        )
        model_dir = work / "models" / "seq-cls"
        data = bench_batching(work, model_dir, repeats=3 if args.quick else 5)
        data["dedicated_vs_shared"] = bench_dedicated_vs_shared(
            work, model_dir, args.rate, duration, warmup, args.zipf, args.shared_slots, not args.no_cold
        )
    data["model"] = "random-init BERT, hidden 64, 2 layers (reward_servers.tiny_models), CPU, 1 torch thread"
    data["instances"] = INSTANCES_NOTE
    data["load"] = {
        "rate_per_s": args.rate,
        "duration_s": duration,
        "warmup_s": warmup,
        "zipf_s": args.zipf,
        "services": 10,
        "shared_slots": args.shared_slots,
        "quick": args.quick,
    }
    write_json("reward", data)
    plot(data, RESULTS / "reward.png")
    b, r, g = data["batching"], data["restore"], data["dedicated_vs_shared"]
    print(INSTANCES_NOTE)
    print(
        f"batched vs one-by-one at batch 32: {b['speedup']:.1f}x ({b['batched_req_per_s']:.0f} vs {b['one_by_one_req_per_s']:.0f} req/s)"
    )
    print(
        f"first call: cached {r['cached_median_s'] * 1000:.1f} ms, from host memory {r['host_median_s'] * 1000:.1f} ms, "
        f"cold {statistics.median(r['cold_s']):.2f} s ({r['cold_over_cached']:.0f}x cached)"
    )
    for k, v in g.items():
        act = f"{v['avg_act_s'] * 1000:.0f} ms" if v["avg_act_s"] is not None else "n/a"
        print(
            f"{k}: {v['declared_gpus']} GPUs declared, wall {v['wall_s']:.1f} s, {v['gpu_seconds']:.0f} GPU-s, "
            f"{v['resident_instance_seconds']:.0f} resident instance-s, {v['busy_instance_seconds']:.1f} busy "
            f"instance-s; avg ACT {act}; {v['requests']} requests ({v['failed_requests']} failed); "
            f"cold loads {v['loads_measured']} ({v['load_s_measured']:.1f} s), host restores "
            f"{v['host_restores_measured']} (p50 {1000 * (v['host_restore_p50_s'] or 0):.1f} ms), evictions "
            f"{v['evictions_measured']} in the measured window"
        )
    print(f"DoP picks by tokens: {data['dop_profile']['picks_by_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
