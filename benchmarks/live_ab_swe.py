"""Live A/B on the SWE-style workload: trajectories that fix a real bug in their task's image.

The workload: `--trajectories` trajectories started together, as in one rollout step; trajectory
k works on task k mod 3 of `tangram_celery/swe/tasks.py` (a pinned PyPI project whose sdist ships
its tests, with one injected bug), in that task's image (`tangram-swe/<task>:bug`: a Debian
bookworm base made by mmdebstrap, python3 and python3-pytest, the buggy repository at /repo; built
and cached by `tangram_celery/swe/build.py`, no registry). Its turns are the scripted agent's steps
(`tangram_celery/swe/agent.py`), each after a think time (lognormal, median `--think-s`, as in
benchmarks/live_ab.py), each a bash code action in the trajectory's image:

1. inspect: `ls` and a grep for the function the issue names (its `def` is found);
2. reproduce: the project's tests of that area (they fail: exit 1, "failed");
3. edit: the fix, made by a Python edit run from bash ("edited");
4. verify: the same tests again (they pass: exit 0, "passed", nothing failed);
5. reward: a `grade` action: the hidden tests, sent pristine, run against the trajectory's source
   changes in a fresh sandbox of the image, judged by the harness (reward 1: status ok, every
   test passed).

Every action is the agent's as it is (one core each: a task's hidden tests are one test, so an
elastic `cpus` would only make the scheduler wait for cores it cannot use).

Every step's outcome is known in advance and checked; a step that does not give it counts as
wrong, and its trajectory fails its task (per-task pass rates below).

Setups, one after another on the same cores (the namespace backend everywhere; every setup reads
the images from one image store, unpacked once before the first setup, so that no setup pays the
unpack):

1. `tangram`: the live stack (Redis, scheduler, CPU worker) with `tangram-fast`, the shipped
   duration priors and time sharing bounds, `sandbox.images.oci_dirs` naming the SWE OCI layout.
1b. `tangram_exclusive` (only with `--setups`): the same with time sharing off.
2. `pod`: one long-lived sandbox of the task's image per trajectory (a pod), started when admitted
   and bound to every core of the node under a CFS quota of `--pod-cap-cores`; pods admitted FCFS
   while their CPU requests (`--pod-request-cores`), memory and `--max-pods` fit the node, as
   kube-scheduler would; the reward runs as the same `grade` in a fresh sandbox of the image.
3. `pod_all`: the same with a pod for every trajectory at once, all time-sharing the cores under
   CFS: what a SandboxFusion deployment or a plain harness does.

On a machine shared with other work the figures move with its load: the JSON keeps each
repetition's figures, their ratios within each repetition, and the CPU seconds every setup's
sandboxes got (`cpu`), so that a drift shows.

ACT is measured by the caller from the end of a turn's think time to its result. Reported per
setup: average, p50, p99 ACT over every repetition's actions, and per repetition (the target:
the median over repetitions of Tangram's average and p99 no worse than pod_all's); the longest
total wait of one trajectory; the queue/exec split (ACT minus execution, and execution); ACT per
step; per-task pass rates; Tangram's overhead breakdown (as live_ab).

Run: .venv/bin/python benchmarks/live_ab_swe.py [--trajectories 6 --think-s 1.5 --cores 2]
    [--repeat 3: every other repetition in reverse order, samples pooled] [--setups pod_all]
The first run builds the images (mmdebstrap and PyPI, about a minute; cached under
~/.cache/tangram/swe). Needs root (the namespace backend's image sandboxes). Writes
benchmarks/results/live_ab_swe.json and .png (about 3-4 minutes a repetition with the defaults
on a busy 2-core machine; `--repeat 3` about 12 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, write_json
from benchmarks.live_ab import (
    Sample,
    drive,
    merge,
    plot,
    scrape_decision,
    shipped_priors,
    summary,
    time_share,
)
from benchmarks.live_ab_stats import PodGate, act_stats, overhead_breakdown, pod_capacity
from tangram_celery.common.actions import ActionStatus, CodeAction
from tangram_celery.swe.agent import steps
from tangram_celery.swe.tasks import TASKS, SweTask


@dataclass(frozen=True)
class SweTurn:
    """One step of a trajectory: `drive` reads `think_s`; `action` has no trajectory id yet."""

    think_s: float
    task: SweTask
    step: str
    action: CodeAction


def workload(n: int, think_s: float, seed: int, hidden: dict[str, dict[str, str]]) -> list[list[SweTurn]]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        t = TASKS[k % len(TASKS)]
        turns = []
        for s in steps(t, "tid", hidden[t.name]):
            turns.append(SweTurn(think_s * math.exp(rng.gauss(0.0, 0.6)), t, s.name, s.action))
        out.append(turns)
    return out


def expected(turn: SweTurn, res: Any) -> str:
    """ "" when the step gave its known outcome, else what it gave instead."""
    status, out = str(res.status), res.stdout or ""
    ok = {
        "inspect": status == "ok" and f"def {turn.task.function}" in out,
        "reproduce": res.exit_code == 1 and " failed" in out,
        "edit": status == "ok" and "edited" in out,
        "verify": status == "ok" and " passed" in out and " failed" not in out,
        "reward": res.status is ActionStatus.OK and bool(res.tests) and all(x.passed for x in res.tests),
    }[turn.step]
    if ok:
        return ""
    detail = getattr(res, "detail", "") or ""
    return f"{turn.step}: status {status}, exit {res.exit_code}, {detail[:200]!r}, stdout {out[-300:]!r}"


class Failures:
    """Steps that did not give their known outcome (a few kept per setup, with what they gave)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.failed: set[int] = set()  # trajectories with a wrong step
        self.examples: list[str] = []

    def note(self, k: int, why: str) -> bool:
        if why:
            with self.lock:
                self.failed.add(k)
                if len(self.examples) < 5:
                    self.examples.append(f"trajectory {k}: {why}")
        return not why


def images_config(store: Path, layout: Path, prewarm: int | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"store_dir": str(store), "docker": False, "oci_dirs": [str(layout)]}
    return cfg | ({"prewarm": prewarm} if prewarm is not None else {})


def run_tangram(
    jobs: list[list[SweTurn]], args: argparse.Namespace, tag: str, share: bool = True
) -> dict[str, Any]:
    from tangram_celery import TangramClient
    from tangram_celery.common.config import parse_config
    from tangram_celery.deploy import Deployment, write_config
    from tangram_celery.store import akey

    tmp = Path(tempfile.mkdtemp(prefix=f"tangram-ab-swe-{tag}-"))
    cfg = parse_config(
        {
            "state_dir": str(tmp / "state"),
            "nodes": {"cpu": [{"name": "n0", "cores": args.cores, "memory_mb": args.memory_mb}]},
            "sandbox": {"backend": "namespace", "images": images_config(args.store, args.layout)},
            "scheduler": {
                "policy": "tangram-fast",
                "priors": shipped_priors(),
                "time_share": time_share(args) if share else {"enabled": False},
            },
        }
    )
    dep = Deployment(cfg, write_config(cfg, tmp / "tangram.yaml"), with_flower=False)
    dep.start(progress=False)
    fails = Failures()
    try:
        client = TangramClient(dep.url)
        keys = ("dispatched_s", "started_s")

        def execute(k: int, t: int, turn: SweTurn) -> tuple[bool, float, dict[str, float]]:
            action = turn.action.model_copy(
                update={"trajectory_id": f"{tag}-{k}", "memory_mb": args.memory_per_trajectory_mb}
            )
            submitted = time.time()
            res = client.submit(action).result(timeout=600)
            received = time.time()
            raw = client.store.r.hmget(akey(res.action_id), *keys)
            parts = {"submitted": submitted, "received": received, "queue_s": res.queue_s}
            parts |= {f: float(v) for f, v in zip(keys, raw, strict=True) if v is not None}
            parts |= {"worker_done": submitted + res.act_s, "exec_s": res.exec_s, "units": float(res.units)}
            parts |= {"cpu_s": res.cpu_s} if res.cpu_s is not None else {}
            return fails.note(k, expected(turn, res)), res.exec_s, parts

        samples, wall = drive(jobs, execute, lambda k: None, lambda k: client.close_trajectory(f"{tag}-{k}"))
        decision = scrape_decision(dep.metrics_ports.get("scheduler"))
        client.close()
    finally:
        dep.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"samples": samples, "wall_s": wall, "decision": decision, "fails": fails}


def run_pods(
    jobs: list[list[SweTurn]], args: argparse.Namespace, tag: str, every_trajectory: bool = False
) -> dict[str, Any]:
    """live_ab's pod model with each pod in its trajectory's image (`image=` on the same
    namespace backend); the reward is the same `grade` (a fresh sandbox of the image)."""
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.sandbox import ExecRequest, open_sandbox

    images = images_config(args.store, args.layout, prewarm=0)  # a pod starts when admitted
    box = open_sandbox(SandboxConfig.model_validate({"backend": "namespace", "prewarm": 0, "images": images}))
    cores = tuple(range(args.pod_cap_cores))  # cpuset + CFS quota of the pod's limit
    mem = args.memory_per_trajectory_mb
    capacity = pod_capacity(args.cores, args.memory_mb, args.pod_request_cores, mem, args.max_pods)
    capacity = len(jobs) if every_trajectory else capacity
    names = [
        f.name for f in fields(ExecRequest) if f.name in CodeAction.model_fields and f.name != "memory_mb"
    ]
    ready = {k: threading.Event() for k in range(len(jobs))}
    starts: dict[int, float] = {}
    failed: dict[int, str] = {}
    fails = Failures()

    def start_pod(k: int) -> None:
        def go() -> None:
            t = time.monotonic()
            req = ExecRequest(
                language="bash", code="true", image=jobs[k][0].task.image, cores=cores, memory_mb=mem
            )
            try:
                res = box.run(f"{tag}-{k}", req)
                if res.status is not ActionStatus.OK:
                    failed[k] = f"pod start: {res.status} {res.detail}"
                starts[k] = time.monotonic() - t
            except Exception as e:  # the trajectory's actions then fail and are counted wrong
                failed[k] = f"pod start: {type(e).__name__}: {e}"
            ready[k].set()

        threading.Thread(target=go, daemon=True).start()

    gate = PodGate(capacity, start_pod)

    def execute(k: int, t: int, turn: SweTurn) -> tuple[bool, float, dict[str, float]]:
        ready[k].wait()
        if k in failed:
            return fails.note(k, failed[k]), 0.0, {}
        req = ExecRequest(**{n: getattr(turn.action, n) for n in names}, cores=cores, memory_mb=mem)
        res = (box.grade if turn.action.grade else box.run)(f"{tag}-{k}", req)
        parts = {"cpu_s": res.cpu_s} if res.cpu_s is not None else {}
        return fails.note(k, expected(turn, res)), res.exec_s, parts

    def end(k: int) -> None:
        box.close_trajectory(f"{tag}-{k}")
        gate.release(k)

    try:
        samples, wall = drive(jobs, execute, gate.request, end)
    finally:
        box.close()
    start_s = sorted(starts.values())
    return {
        "samples": samples,
        "wall_s": wall,
        "fails": fails,
        "capacity": capacity,
        "pod_start_s_p50": start_s[len(start_s) // 2] if start_s else None,
    }


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Build (or find cached) the task images; unpack them into the run's image store once."""
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.sandbox import ExecRequest, open_sandbox
    from tangram_celery.swe.build import build, hidden_files

    t0 = time.monotonic()
    built = build(TASKS)
    args.layout = built.layout
    args.store = Path(tempfile.mkdtemp(prefix="tangram-ab-swe-store-")) / "store"
    t1 = time.monotonic()
    images = images_config(args.store, args.layout, prewarm=0)
    box = open_sandbox(SandboxConfig.model_validate({"backend": "namespace", "prewarm": 0, "images": images}))
    try:
        for t in TASKS:
            res = box.run(f"unpack-{t.name}", ExecRequest(language="bash", code="true", image=t.image))
            if res.status is not ActionStatus.OK:
                raise SystemExit(f"{t.image} does not run: {res.status} {res.detail} {res.stderr[-500:]}")
            box.close_trajectory(f"unpack-{t.name}")
    finally:
        box.close()
    return {
        "hidden": {t.name: hidden_files(t) for t in TASKS},
        "build_s": round(t1 - t0, 2),
        "unpack_s": round(time.monotonic() - t1, 2),
        "images": [t.image for t in TASKS],
    }


def per_task(run: dict[str, Any], jobs: list[list[SweTurn]], reps: int) -> dict[str, Any]:
    """Per task: trajectories run (every repetition) and the share whose every step was right."""
    out: dict[str, Any] = {}
    for t in TASKS:
        ks = [k for k in range(len(jobs)) if jobs[k][0].task.name == t.name]
        bad = sum(len(f.failed & set(ks)) for f in run["fails_all"])
        out[t.name] = {
            "trajectories": len(ks) * reps,
            "pass_rate": 1 - bad / (len(ks) * reps) if ks else None,
        }
    return out


def step_acts(samples: list[Sample], jobs: list[list[SweTurn]]) -> dict[str, dict[str, float]]:
    by: dict[str, list[Sample]] = {}
    for s in samples:
        by.setdefault(jobs[s.trajectory][s.turn].step, []).append(s)
    out = {}
    for step, xs in by.items():
        row = {"act_s_avg": avg([s.act_s for s in xs]), "exec_s_avg": avg([s.exec_s for s in xs])}
        if all("cpu_s" in s.parts for s in xs):  # CPU seconds its sandbox got while it ran
            row["cpu_s_avg"] = avg([s.parts["cpu_s"] for s in xs])
        ps = [
            s.parts for s in xs if {"submitted", "dispatched_s", "started_s", "worker_done"} <= s.parts.keys()
        ]
        if ps:  # Tangram: waited before dispatch; the worker's time besides execution (sandbox start)
            row["dispatch_wait_s_avg"] = avg([p["dispatched_s"] - p["submitted"] for p in ps])
            row["worker_prep_s_avg"] = avg([p["worker_done"] - p["started_s"] - p["exec_s"] for p in ps])
        out[step] = row
    return out


def cpu_share(run: dict[str, Any]) -> dict[str, float] | None:
    """The CPU seconds the setup's sandboxes got (summed over its actions), and that per second of
    makespan: on a machine shared with other work, a setup that runs more processes at once
    takes a larger share of it (CFS shares by runnable task and cgroup)."""
    cpu = [s.parts.get("cpu_s") for s in run["samples"]]
    if any(c is None for c in cpu):
        return None
    total = sum(c for c in cpu if c is not None)
    return {
        "cpu_s_per_repetition": total / len(run["makespans_s"]),
        "cores_used": total / sum(run["makespans_s"]),
    }


def paired(base: list[dict[str, float]], tg: list[dict[str, float]], key: str) -> dict[str, Any]:
    ratios = [b[key] / t[key] for b, t in zip(base, tg, strict=True)]
    return {"each": ratios, "median": statistics.median(ratios)}


def avg(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def medians(reps: list[dict[str, float]]) -> dict[str, float]:
    return {f"{k}_median": statistics.median(r[k] for r in reps) for k in ("avg", "p50", "p99")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=6, help="two per task by default")
    ap.add_argument("--think-s", type=float, default=1.5, help="median think time before each step")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--memory-mb", type=int, default=8192)
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
        "--time-share", default=None, help="JSON laid over the shipped scheduler.time_share bounds"
    )
    ap.add_argument("--setups", default=None, help="comma-separated setups (default: tangram,pod,pod_all)")
    ap.add_argument("--out", default="live_ab_swe")
    args = ap.parse_args()
    args.pod_cap_cores = args.pod_cap_cores or min(4, args.cores)
    try:
        prep = prepare(args)
        print(f"images ready: build {prep['build_s']} s, unpack {prep['unpack_s']} s", flush=True)
        jobs = workload(args.trajectories, args.think_s, args.seed, prep["hidden"])
        runs, reps, order = run_setups(jobs, args)
    finally:  # the run's image store: hundreds of MB of unpacked images
        if getattr(args, "store", None) is not None:
            shutil.rmtree(args.store.parent, ignore_errors=True)
    report(args, prep, jobs, runs, reps, order)
    return 0


def run_setups(
    jobs: list[list[SweTurn]], args: argparse.Namespace
) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, float]]], list[str]]:
    """Every setup `--repeat` times: pooled runs, each repetition's ACT stats, the order run."""
    setups_fn: dict[str, Callable[[str], dict[str, Any]]] = {
        "tangram": lambda tag: run_tangram(jobs, args, tag),
        "tangram_exclusive": lambda tag: run_tangram(jobs, args, tag, share=False),
        "pod": lambda tag: run_pods(jobs, args, tag),
        "pod_all": lambda tag: run_pods(jobs, args, tag, every_trajectory=True),
    }
    keep = {"tangram", *(args.setups.split(",") if args.setups else ("pod", "pod_all"))}
    setups_fn = {name: fn for name, fn in setups_fn.items() if name in keep}
    runs: dict[str, dict[str, Any]] = {}
    reps: dict[str, list[dict[str, float]]] = {name: [] for name in setups_fn}
    order: list[str] = []
    for rep in range(args.repeat):
        # every other repetition in reverse order: a drift of the shared machine's load over the
        # run then falls on every setup alike
        for name in list(setups_fn) if rep % 2 == 0 else list(reversed(setups_fn)):
            print(f"running {name} (repetition {rep + 1}/{args.repeat}) ...", flush=True)
            load_before = os.getloadavg()[0]
            run = setups_fn[name](f"{name}{rep}")
            load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            reps[name].append(act_stats([s.act_s for s in run["samples"]]))
            fails = run.pop("fails")
            runs[name] = merge(runs.get(name), run, load)
            runs[name].setdefault("fails_all", []).append(fails)
            order.append(name)
            print(f"  {name}: {json.dumps(reps[name][-1])}; wrong steps: {fails.examples}", flush=True)
    return runs, reps, order


def report(
    args: argparse.Namespace,
    prep: dict[str, Any],
    jobs: list[list[SweTurn]],
    runs: dict[str, dict[str, Any]],
    reps: dict[str, list[dict[str, float]]],
    order: list[str],
) -> None:
    """Summaries, ratios and the overhead breakdown, written to the JSON and the plot."""
    setups = {}
    for name, run in runs.items():
        s = summary(run)
        s["queue_s_avg"] = sum(x.act_s - x.exec_s for x in run["samples"]) / len(run["samples"])
        s["per_repetition_act_s"] = reps[name]
        s["cpu"] = cpu_share(run)
        s["act_s_over_repetitions"] = medians(reps[name])
        s["steps"] = step_acts(run["samples"], jobs)
        s["tasks"] = per_task(run, jobs, len(reps[name]))
        s["wrong_examples"] = [e for f in run["fails_all"] for e in f.examples][:5]
        setups[name] = s
    tg = setups["tangram"]["act_s_over_repetitions"]
    target = {
        base: {
            "avg_ratio": setups[base]["act_s_over_repetitions"]["avg_median"] / tg["avg_median"],
            "p99_ratio": setups[base]["act_s_over_repetitions"]["p99_median"] / tg["p99_median"],
            # the same within each repetition (setups run minutes apart, not hours): steadier
            # than the ratio of medians when the machine's load drifts between repetitions
            "avg_ratio_per_repetition": paired(reps[base], reps["tangram"], "avg"),
            "p99_ratio_per_repetition": paired(reps[base], reps["tangram"], "p99"),
        }
        for base in ("tangram_exclusive", "pod", "pod_all")
        if base in setups
    }
    tg_run = runs["tangram"]
    overhead = overhead_breakdown([s.parts for s in tg_run["samples"]], tg_run["decision"], tg_run["wall_s"])
    data = {
        "workload": {
            "kind": "swe",
            "trajectories": args.trajectories,
            "steps": [t.step for t in jobs[0]],
            "tasks": [f"{t.project}=={t.version} ({t.function})" for t in TASKS],
            "think_s_median": args.think_s,
            "cores": args.cores,
            "memory_mb": args.memory_mb,
            "seed": args.seed,
            "repeat": args.repeat,
        },
        "images": {k: v for k, v in prep.items() if k != "hidden"},
        "order": order,
        "priors": shipped_priors(),
        "time_share": time_share(args),
        "pod": {
            "cap_cores": args.pod_cap_cores,
            "request_cores": args.pod_request_cores,
            "memory_mb": args.memory_per_trajectory_mb,
            "max_pods": args.max_pods,
            "capacity": runs.get("pod", {}).get("capacity"),
            "start_s_p50": runs.get("pod", {}).get("pod_start_s_p50"),
            "all_start_s_p50": runs.get("pod_all", {}).get("pod_start_s_p50"),
        },
        "setups": setups,
        # base / tangram of the median over repetitions (> 1: tangram is faster)
        "ratios_vs_tangram": target,
        "loans": {n: r["decision"].get("loans", 0.0) for n, r in runs.items() if "decision" in r},
        "time_shares": {n: r["decision"].get("time_shares", 0.0) for n, r in runs.items() if "decision" in r},
        "tangram_overhead": overhead,
        "samples": {
            name: [
                asdict(s) | {"parts": None, "step": jobs[s.trajectory][s.turn].step} for s in run["samples"]
            ]
            for name, run in runs.items()
        },
    }
    write_json(args.out, data)
    plot(runs, RESULTS / f"{args.out}.png")
    print(
        json.dumps(
            {"ratios_vs_tangram": target, "act": {n: s["act_s_over_repetitions"] for n, s in setups.items()}},
            indent=1,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
