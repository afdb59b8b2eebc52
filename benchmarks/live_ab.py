"""Live A/B on real execution: one agentic coding workload, run five ways one after another, same cores.

The workload: `--trajectories` multi-turn trajectories started together, as in one rollout
step. Each turn is a think time (the policy generating its next message; lognormal, median
`--think-s`) followed by a code action in the trajectory's persistent sandbox: the first turn
writes a module (`sol.py`) that later turns import; a plain turn prints a CPU-bound result; every
third turn and the last one run a test suite (`test_cases`, elastic `cpus="1..N"`). Every output
is known in advance and checked.

1. `tangram`: the live stack (`tangram up`-style deployment: Redis, scheduler, CPU worker) with
   `tangram-fast`, on a CPU node of `--cores` cores, with the duration priors and the time
   sharing bounds `configs/local.yaml` ships (`--time-share` overrides the bounds).
1b. `tangram_exclusive`: the same with time sharing off (`scheduler.time_share.enabled: false`):
   every action on cores of its own.
2. `fixed-dop`: the same stack with `fixed-dop-K` (every elastic action at DoP K, FCFS; its
   execution model is Tangram's own, so the live service runs it).
3. `pod`: the pod-per-trajectory model with no scheduler: one long-lived sandbox (the same
   namespace backend) per trajectory, bound to every core of the node under a fixed CFS quota
   (`--pod-cap-cores`, a pod's CPU limit), so pods time-share the cores as under the kubelet.
   Pods are admitted FCFS while the node's pod capacity holds, as kube-scheduler would: the
   sum of CPU requests (`--pod-request-cores`, default 0.5 as in `static-pod`) within the
   cores, memory within the node's, at most `--max-pods`. A pod is started when admitted
   (overlapping its trajectory's first think time) and lives until its trajectory ends; an
   action whose pod is not running yet waits for it. Kubernetes' own costs (API binding,
   image pull, kubelet start-up) are not charged: only the sandbox start is.
4. `pod_all`: the same with a pod for every trajectory at once (requests small enough, or a
   cluster sized for the whole batch): no admission wait, all pods time-share the cores.

ACT is measured by the caller in every setup: from the moment the action is ready (end of its
think time) to the moment its result is in hand. Beside the averages: the p99 ACT, the longest
total wait of one trajectory (ACT minus execution, summed over its actions) and the longest
total time of one trajectory in its actions (ACT summed: a time sharer waits little but runs
slower). For Tangram the scheduling overhead is split
out per action: the decision (the scheduler's busy share of the action's wait, from its
`tangram_decision_seconds` metric, plus the mean round), and the dispatch hop (persisted as
dispatched -> claimed by the worker); worker-side preparation (sandbox lookup and binding) and
result delivery are reported beside it.

Run: .venv/bin/python benchmarks/live_ab.py [--trajectories 12 --turns 6 --think-s 1.5 --size 1000000]
    [--repeat N: N repetitions, every other one in reverse order, samples pooled]
    [--time-share '{"weight": 0.5}': time sharing bounds other than the shipped ones]
Writes benchmarks/results/live_ab.json and live_ab.png (about 2-4 minutes with the defaults; more
trajectories, turns or --size for a longer, more loaded run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, write_json
from benchmarks.live_ab_stats import PodGate, act_stats, overhead_breakdown, pod_capacity, trajectory_waits
from tangram_celery import CodeAction, TangramClient
from tangram_celery.common.actions import TestCase

MODULE = "def work(n):\n    return sum(i * i for i in range(n))\n"


@dataclass(frozen=True)
class Turn:
    think_s: float
    code: str
    expect_stdout: str
    files: dict[str, str] = field(default_factory=dict)
    tests: tuple[tuple[str, str], ...] = ()  # (name, assert snippet)


def work(n: int) -> int:
    return sum(i * i for i in range(n))


def workload(trajectories: int, turns: int, think_s: float, size: int, seed: int) -> list[list[Turn]]:
    """Every trajectory's turns; sizes in loop iterations (~0.1 s per million here)."""
    rng = random.Random(seed)
    out = []
    for _ in range(trajectories):
        turns_k = []
        for t in range(turns):
            think = think_s * math.exp(rng.gauss(0.0, 0.6))
            n = int(size * rng.uniform(0.5, 1.5))
            code = f"import sol\nprint(sol.work({n}))\n"
            files = {"sol.py": MODULE} if t == 0 else {}
            tests: tuple[tuple[str, str], ...] = ()
            if t % 3 == 2 or t == turns - 1:
                ms = [int(size * rng.uniform(0.5, 1.0)) for _ in range(8)]
                tests = tuple(
                    (f"t{i}", f"import sol\nassert sol.work({m}) == {work(m)}") for i, m in enumerate(ms)
                )
            turns_k.append(Turn(think, code, f"{work(n)}\n", files, tests))
        out.append(turns_k)
    return out


@dataclass
class Sample:
    trajectory: int
    turn: int
    ready_s: float  # relative to the start of the setup's run
    done_s: float
    act_s: float
    exec_s: float
    ok: bool
    parts: dict[str, float] = field(default_factory=dict)  # Tangram: per-action timestamps


Execute = Callable[[int, int, Turn], tuple[bool, float, dict[str, float]]]


def drive(
    jobs: list[list[Turn]], execute: Execute, begin: Callable[[int], None], end: Callable[[int], None]
) -> tuple[list[Sample], float]:
    """Run every trajectory in its own thread (all start together); returns samples, wall s."""
    samples: list[Sample] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def one(k: int) -> None:
        begin(k)
        for t, turn in enumerate(jobs[k]):
            time.sleep(turn.think_s)
            ready = time.monotonic()
            ok, exec_s, parts = execute(k, t, turn)
            done = time.monotonic()
            with lock:
                samples.append(Sample(k, t, ready - t0, done - t0, done - ready, exec_s, ok, parts))
        end(k)

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return samples, time.monotonic() - t0


def code_action(tid: str, turn: Turn, cores: int, memory_mb: int) -> CodeAction:
    cases = [TestCase(name=n, assert_code=a) for n, a in turn.tests]
    return CodeAction(
        trajectory_id=tid,
        code=turn.code,
        files=turn.files,
        test_cases=cases,
        cpus=f"1..{cores}" if cases else 1,
        memory_mb=memory_mb,
        timeout_s=120,
    )


def checked(stdout: str, status: str, tests: list[Any], turn: Turn) -> bool:
    return status == "ok" and stdout == turn.expect_stdout and len(tests) == len(turn.tests)


def run_tangram(
    policy: str, jobs: list[list[Turn]], args: argparse.Namespace, tag: str, share: bool = True
) -> dict[str, Any]:
    from tangram_celery.common.config import parse_config
    from tangram_celery.deploy import Deployment, write_config
    from tangram_celery.store import akey

    tmp = Path(tempfile.mkdtemp(prefix=f"tangram-ab-{tag}-"))
    cfg = parse_config(
        {
            "state_dir": str(tmp / "state"),
            "nodes": {"cpu": [{"name": "n0", "cores": args.cores, "memory_mb": args.memory_mb}]},
            "sandbox": {"backend": "namespace"},
            "scheduler": {
                "policy": policy,
                "priors": shipped_priors(),
                "time_share": time_share(args) if share else {"enabled": False},
            },
        }
    )
    dep = Deployment(cfg, write_config(cfg, tmp / "tangram.yaml"), with_flower=False)
    dep.start(progress=False)
    try:
        client = TangramClient(dep.url)
        fields = ("dispatched_s", "started_s")

        def execute(k: int, t: int, turn: Turn) -> tuple[bool, float, dict[str, float]]:
            submitted = time.time()
            res = client.submit(
                code_action(f"{tag}-{k}", turn, args.cores, args.memory_per_trajectory_mb)
            ).result(timeout=600)
            received = time.time()
            raw = client.store.r.hmget(akey(res.action_id), *fields)
            parts = {"submitted": submitted, "received": received, "queue_s": res.queue_s}
            parts |= {f: float(v) for f, v in zip(fields, raw, strict=True) if v is not None}
            parts |= {"worker_done": submitted + res.act_s, "exec_s": res.exec_s, "units": float(res.units)}
            return checked(res.stdout, str(res.status), res.tests, turn), res.exec_s, parts

        samples, wall = drive(jobs, execute, lambda k: None, lambda k: client.close_trajectory(f"{tag}-{k}"))
        decision = scrape_decision(dep.metrics_ports.get("scheduler"))
        client.close()
    finally:
        dep.stop()
    return {"policy": policy, "samples": samples, "wall_s": wall, "decision": decision}


def shipped(key: str) -> dict[str, Any]:
    """A `scheduler:` block configs/local.yaml ships (what `tangram up` starts with)."""
    import yaml

    from benchmarks.common import ROOT

    return dict(yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["scheduler"].get(key) or {})


def shipped_priors() -> dict[str, Any]:
    """The duration priors configs/local.yaml ships: without a prior an elastic kind is believed
    serial (p = 0) and no policy ever grants it a second core."""
    return shipped("priors")


def time_share(args: argparse.Namespace) -> dict[str, Any]:
    """The time sharing bounds under test: the shipped ones, with `--time-share` laid over them."""
    return shipped("time_share") | json.loads(args.time_share or "{}")


def scrape_decision(port: int | None) -> dict[str, float]:
    """The scheduler's `tangram_decision_seconds` sum and count, the core loans it sent
    (`loans`: changes of a running suite's lent cores, `tangram_core_loans_total`) and the
    actions it started time-sharing held cores (`time_shares`, `tangram_time_shares_total`)."""
    if port is None:
        return {}
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {"loans": 0.0, "time_shares": 0.0}
    for line in text.splitlines():
        for name in ("sum", "count"):
            if line.startswith(f"tangram_decision_seconds_{name} "):
                out[name] = float(line.split()[-1])
        if line.startswith("tangram_core_loans_total{"):
            out["loans"] += float(line.split()[-1])
        if line.startswith("tangram_time_shares_total{"):
            out["time_shares"] += float(line.split()[-1])
    return out


def run_pods(
    jobs: list[list[Turn]], args: argparse.Namespace, every_trajectory: bool = False
) -> dict[str, Any]:
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.sandbox import ExecRequest, open_sandbox

    box = open_sandbox(SandboxConfig(backend="namespace", prewarm=0))
    cores = tuple(range(args.pod_cap_cores))  # cpuset + CFS quota of the pod's limit
    mem = args.memory_per_trajectory_mb
    capacity = pod_capacity(args.cores, args.memory_mb, args.pod_request_cores, mem, args.max_pods)
    if every_trajectory:  # requests small enough (or nodes enough) for every trajectory's pod at once
        capacity = len(jobs)
    ready = {k: threading.Event() for k in range(len(jobs))}
    starts: dict[int, float] = {}
    failed: dict[int, str] = {}

    def start_pod(k: int) -> None:
        def go() -> None:
            t = time.monotonic()
            try:
                box.run(f"pod-{k}", ExecRequest(language="python", code="pass", cores=cores, memory_mb=mem))
                starts[k] = time.monotonic() - t
            except Exception as e:  # the trajectory's actions then fail and are counted wrong
                failed[k] = f"{type(e).__name__}: {e}"
            ready[k].set()

        threading.Thread(target=go, daemon=True).start()

    gate = PodGate(capacity, start_pod)

    def execute(k: int, t: int, turn: Turn) -> tuple[bool, float, dict[str, float]]:
        ready[k].wait()
        if k in failed:
            return False, 0.0, {}
        cases = [TestCase(name=n, assert_code=a) for n, a in turn.tests]
        req = ExecRequest(
            language="python",
            code=turn.code,
            files=dict(turn.files),
            test_cases=cases,
            timeout_s=120,
            memory_mb=mem,
            cores=cores,
        )
        res = box.run(f"pod-{k}", req)
        return checked(res.stdout, str(res.status), res.tests, turn), res.exec_s, {}

    def end(k: int) -> None:
        box.close_trajectory(f"pod-{k}")
        gate.release(k)

    try:
        samples, wall = drive(jobs, execute, gate.request, end)
    finally:
        box.close()
    start_s = sorted(starts.values())
    return {
        "samples": samples,
        "wall_s": wall,
        "capacity": capacity,
        "pod_start_s_p50": start_s[len(start_s) // 2] if start_s else None,
        "pod_start_failures": sorted(failed.values())[:5],
    }


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """ACT over every repetition's samples; throughput = actions / summed makespans."""
    samples: list[Sample] = run["samples"]
    makespans: list[float] = run["makespans_s"]
    return {
        "act_s": act_stats([s.act_s for s in samples]),
        **trajectory_waits([(s.trajectory, s.act_s, s.exec_s) for s in samples]),
        "exec_s_avg": sum(s.exec_s for s in samples) / len(samples),
        "actions": len(samples),
        "wrong": sum(1 for s in samples if not s.ok),
        "makespan_s": sum(makespans) / len(makespans),
        "makespans_s": makespans,
        "throughput_per_s": len(samples) / sum(makespans),
        "load_avg_1m_before_after": run["load_avg_1m"],
    }


def merge(into: dict[str, Any] | None, run: dict[str, Any], load: list[float]) -> dict[str, Any]:
    """Pool one repetition of a setup into its earlier ones."""
    makespan = max(s.done_s for s in run["samples"])
    if into is None:
        return run | {"makespans_s": [makespan], "load_avg_1m": [load]}
    into["samples"] += run["samples"]
    into["makespans_s"].append(makespan)
    into["load_avg_1m"].append(load)
    into["wall_s"] += run["wall_s"]
    for key in ("sum", "count", "loans", "time_shares"):
        if "decision" in into:
            into["decision"][key] = into["decision"].get(key, 0.0) + run["decision"].get(key, 0.0)
    return into


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--think-s", type=float, default=1.5, help="median think time between turns")
    ap.add_argument("--size", type=int, default=1_000_000, help="loop iterations of a turn (about 0.1 s)")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--memory-mb", type=int, default=8192)
    ap.add_argument("--fixed-dop", type=int, default=None, help="K of fixed-dop-K (default: --cores)")
    ap.add_argument(
        "--pod-cap-cores", type=int, default=None, help="pod CPU limit (default: min(4, --cores))"
    )
    ap.add_argument("--pod-request-cores", type=float, default=0.5)
    ap.add_argument(
        "--memory-per-trajectory-mb", type=int, default=512, help="a pod's memory; Tangram's memory_mb"
    )
    ap.add_argument("--max-pods", type=int, default=110)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="repetitions, alternating the setups' order")
    ap.add_argument(
        "--time-share", default=None, help="JSON laid over the shipped scheduler.time_share bounds (tangram)"
    )
    ap.add_argument(
        "--setups", default=None, help="comma-separated setups to run (default: all; tangram always)"
    )
    ap.add_argument("--out", default="live_ab")
    args = ap.parse_args()
    args.fixed_dop = args.fixed_dop or args.cores
    args.pod_cap_cores = args.pod_cap_cores or min(4, args.cores)
    jobs = workload(args.trajectories, args.turns, args.think_s, args.size, args.seed)
    setups_fn: dict[str, Callable[[], dict[str, Any]]] = {
        "tangram": lambda: run_tangram("tangram-fast", jobs, args, "tg"),
        "tangram_exclusive": lambda: run_tangram("tangram-fast", jobs, args, "tx", share=False),
        "fixed_dop": lambda: run_tangram(f"fixed-dop-{args.fixed_dop}", jobs, args, "fd"),
        "pod": lambda: run_pods(jobs, args),
        "pod_all": lambda: run_pods(jobs, args, every_trajectory=True),
    }
    if args.setups:
        keep = {"tangram", *args.setups.split(",")}
        setups_fn = {name: fn for name, fn in setups_fn.items() if name in keep}
    runs: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    for rep in range(args.repeat):
        # every other repetition in reverse order: a drift of the shared machine's load over
        # the run then falls on every setup alike
        for name in list(setups_fn) if rep % 2 == 0 else list(reversed(setups_fn)):
            print(f"running {name} (repetition {rep + 1}/{args.repeat}) ...", flush=True)
            load_before = os.getloadavg()[0]
            run = setups_fn[name]()
            load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            runs[name] = merge(runs.get(name), run, load)
            order.append(name)
            print(f"  {name}: {json.dumps(summary(runs[name]))}", flush=True)
    setups = {name: summary(run) for name, run in runs.items()}
    tg = setups["tangram"]
    ratios = {
        base: {
            "avg_act": setups[base]["act_s"]["avg"] / tg["act_s"]["avg"],
            "p50_act": setups[base]["act_s"]["p50"] / tg["act_s"]["p50"],
            "p99_act": setups[base]["act_s"]["p99"] / tg["act_s"]["p99"],
            "throughput": tg["throughput_per_s"] / setups[base]["throughput_per_s"],
        }
        for base in ("tangram_exclusive", "fixed_dop", "pod", "pod_all")
        if base in setups
    }
    tg_run = runs["tangram"]
    overhead = overhead_breakdown([s.parts for s in tg_run["samples"]], tg_run["decision"], tg_run["wall_s"])
    data = {
        "workload": {
            "trajectories": args.trajectories,
            "turns": args.turns,
            "think_s_median": args.think_s,
            "size": args.size,
            "cores": args.cores,
            "memory_mb": args.memory_mb,
            "seed": args.seed,
            "repeat": args.repeat,
        },
        "order": order,
        "policies": {
            "tangram": "tangram-fast",
            "tangram_exclusive": "tangram-fast (time sharing off)",
            "fixed_dop": f"fixed-dop-{args.fixed_dop}",
            "pod": "none",
            "pod_all": "none",
        },
        "priors": shipped_priors(),
        "time_share": time_share(args),
        "pod": {
            "cap_cores": args.pod_cap_cores,
            "request_cores": args.pod_request_cores,
            "memory_mb": args.memory_per_trajectory_mb,
            "max_pods": args.max_pods,
            "capacity": runs.get("pod", {}).get("capacity"),
            "start_s_p50": runs.get("pod", {}).get("pod_start_s_p50"),
            "start_failures": runs.get("pod", {}).get("pod_start_failures"),
            "all_capacity": runs.get("pod_all", {}).get("capacity"),
            "all_start_s_p50": runs.get("pod_all", {}).get("pod_start_s_p50"),
        },
        "setups": setups,
        # core loans the scheduler sent (every repetition): how often a suite was resized
        "loans": {name: run["decision"].get("loans", 0.0) for name, run in runs.items() if "decision" in run},
        # actions started beside a running one on its cores (every repetition)
        "time_shares": {
            name: run["decision"].get("time_shares", 0.0) for name, run in runs.items() if "decision" in run
        },
        "ratios_vs_tangram": ratios,
        "tangram_overhead": overhead,
        "samples": {
            name: [asdict(s) | {"parts": None} for s in run["samples"]] for name, run in runs.items()
        },
    }
    write_json(args.out, data)
    plot(runs, RESULTS / f"{args.out}.png")
    print(json.dumps({"ratios_vs_tangram": ratios, "tangram_overhead": overhead}, indent=1))
    return 0


def plot(runs: dict[str, dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, run in runs.items():
        acts = sorted(s.act_s for s in run["samples"])
        a1.plot(acts, [(i + 1) / len(acts) for i in range(len(acts))], label=name)
        a2.plot(sorted(s.done_s for s in run["samples"]), range(1, len(acts) + 1), label=name)
    a1.set_xscale("log")
    a1.set_xlabel("ACT (s)")
    a1.set_ylabel("fraction of actions")
    a1.set_title("ACT CDF")
    a2.set_xlabel("time (s)")
    a2.set_ylabel("actions completed")
    a2.set_title("throughput")
    a1.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
