"""Stateless callers through the client: new trajectories and one-shot actions vs a plain harness.

A SandboxFusion-style caller has no notion of a trajectory's life: one action per program, each
with a trajectory id of its own, never closed (or no trajectory at all). This runs a `tangram
up`-style deployment (embedded Redis, scheduler, CPU worker; `configs/local.yaml`'s settings:
2 cores, 8 GiB of sandbox memory, 512 MiB per trajectory, 2 ready sandboxes) and measures,
side by side in one run, through `TangramClient`:

1. latency: the first action of a new trajectory against an action in an existing warm
   sandbox (trivial snippet, one at a time, alternating): p50 of each, client wall time.
   Target: new p50 within 5 ms of warm p50.
2. the 164 HumanEval reference programs (tests/problems: prompt + canonical solution, the
   problem's check as an assert test) as 164 fresh trajectories, never closed, submitted at
   once: wall time until the last result; all must pass. The same as 164 one-shot actions
   (no trajectory). The broken variants as fresh trajectories: all must fail.
3. the plain harness: the same programs, 2 worker processes, a fresh `/usr/bin/python3 -c`
   per program (program + its check), no isolation. Target: (2) <= 0.8 x (3), best of each;
   also reported paired by round (each run against the plain run just before it, median).
   The strongest plain harness too (`plain-isolated`: `python3 -I -S -c`, no `site` import,
   issue 36's yardstick): target (2) <= 1.0 x it, paired by round.
4. for reference, the programs spread over 2 long-lived trajectories (no sandbox starts), and
   over `ROTATION` (14) used in turn: as many sandboxes as a new trajectory per program cycles
   through (the 16 the node's memory holds, less the 2 ready), each cold in the caches when its
   turn comes, but no scrub and no new occupant. Between the two warm runs and the new
   trajectories, it tells what of a new trajectory's extra CPU is the rotation, and what the
   scrub and the hand-over.
5. first contact: before all of the above, right after the deployment has started and settled,
   the plain harness and then (2) once: the first burst of new trajectories, which finds no
   idle trajectory to evict and so no sandbox to recycle (`sandbox.ready_idle`), with the
   sandboxes the CPU worker started on demand during it; and the same, before everything else,
   on a deployment whose idle worker starts no sandboxes ahead (`ready_idle: 0`, the behaviour
   before it existed).
6. the new trajectories of (2) again on a second deployment, alive beside the first, whose
   verifiers judge one occupant's tests only (`sandbox.verifier_scope: occupant`, the behaviour
   before the default became `job`): each new trajectory then has a verifier forked for it.
Before each run the stack is let settle (`settle`: its ready pool grown, its disposer done),
so that neither it nor the plain harness runs beside the other's leftovers.
Each run also records how busy the machine's cores were (the share of CPU time not idle: the
plain harness keeps both busy, the stack idles while it waits between its steps), and the
deployment how many riders it queued behind batches still running (`cpu_batch.join_below`).
Rounds alternate between the variants (best of `--rounds` each). The machine's load average
and a Python speed yardstick are recorded, since other jobs share the machine. Beside the wall
times, each run's CPU seconds (every process involved: the client or the harness and its
interpreters, Redis, scheduler, workers, sandboxes) per program: other jobs barely move it;
and the same split by part (client, scheduler, Redis, CPU worker, its sandboxes, the rest),
which tells where a new trajectory's extra cost goes. On the Docker backend the sandboxes are the
processes of the engine's containers (children of its shims), and `engine` the private engine
itself (dockerd, containerd, the shims); a container removed during a run takes its CPU with it.

Run: .venv/bin/python benchmarks/stateless.py [--rounds 3] [--backend namespace|docker]
Writes benchmarks/results/stateless.json and stateless.png.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml

from benchmarks.common import (
    RESULTS,
    busy_between,
    cpu_between,
    cpu_ticks,
    percentile,
    proc_table,
    tree_cpu_s,
    write_json,
)
from tangram_celery import ActionStatus, CodeAction, TangramClient
from tangram_celery.common.config import load_config
from tangram_celery.deploy import Deployment
from tests.problems import Problem, humaneval_problems

ENGINE: list[str] = []  # the Docker engine's URL, on the Docker backend (`engine_parts`)
PY = "/usr/bin/python3"  # the interpreter the sandboxes run, for a fair comparison
THROUGH_STACK = ("fresh", "fresh-occupant", "one-shot", "warm", "warm-many")  # references through the stack
ROTATION = 14  # long-lived trajectories used in turn (`warm-many`): 8 GiB / 512 MiB, less 2 ready
LOCAL = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"


def machine_us() -> float:
    """Best of 5: microseconds for sum(range(10000)) (a yardstick of this machine's speed)."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        sum(range(10000))
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


@contextlib.contextmanager
def deployment(backend: str, docker_host: str | None, prewarm: int, **sandbox: Any) -> Iterator[Deployment]:
    """configs/local.yaml's CPU node, sandbox and scheduler settings, with a private state dir,
    the chosen backend, no Flower, and without the GPU node and reward models (a Triton server
    warming models in the background would share the 2 cores with what is measured); `sandbox`
    overrides settings of its `sandbox` section."""
    cfg = yaml.safe_load(LOCAL.read_text())
    cfg["nodes"]["gpu"] = []
    cfg["reward_models"] = []
    with tempfile.TemporaryDirectory(prefix="tangram-stateless-") as tmp:
        cfg["state_dir"] = f"{tmp}/state"
        cfg["broker"]["data_dir"] = f"{tmp}/state/redis"
        cfg["sandbox"].update(backend=backend, prewarm=prewarm, **sandbox)
        if docker_host:
            cfg["sandbox"]["docker_host"] = docker_host
        path = Path(tmp) / "tangram.yaml"
        path.write_text(yaml.safe_dump(cfg))
        dep = Deployment(load_config(path), path, with_flower=False)
        try:
            dep.start(progress=False)
            yield dep
        finally:
            dep.stop()


def latency(client: TangramClient, n: int) -> dict[str, Any]:
    """Client wall ms of a trivial action: in a warm trajectory vs the first of a new one."""
    warm_ms: list[float] = []
    new_ms: list[float] = []
    tag = os.urandom(3).hex()
    assert client.submit(CodeAction(trajectory_id=f"warm-{tag}", code="pass")).result(timeout=60).ok
    for i in range(n + 3):
        for kind, tid in (("warm", f"warm-{tag}"), ("new", f"new-{tag}-{i}")):
            t0 = time.perf_counter()
            res = client.submit(CodeAction(trajectory_id=tid, code="pass")).result(timeout=60)
            ms = (time.perf_counter() - t0) * 1000
            assert res.ok and not res.sandbox_reset, res
            if i >= 3:  # warm-up
                (warm_ms if kind == "warm" else new_ms).append(ms)
        time.sleep(0.15)  # a caller's think time: the ready pool refills meanwhile
    warm, new = percentile(warm_ms, 0.5), percentile(new_ms, 0.5)
    return {
        "warm_p50_ms": warm,
        "new_p50_ms": new,
        "warm_p90_ms": percentile(warm_ms, 0.9),
        "new_p90_ms": percentile(new_ms, 0.9),
        "new_minus_warm_p50_ms": new - warm,
        "n": n,
    }


def own_cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (the plain harness's runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def stack_parts(dep: Deployment) -> dict[str, list[int]]:
    """The deployment's processes by part: the CPU worker's own processes apart from its
    sandboxes (their runners, zygotes, verifiers and user processes), the scheduler, Redis, and
    the rest (API workers, HTTP front end)."""
    parts: dict[str, list[int]] = {
        "cpu worker": [],
        "sandboxes": [],
        "scheduler": [],
        "redis": [],
        "rest": [],
    }
    for name, child in dep.children.items():
        pid = child.proc.pid
        if name.startswith("worker-cpu"):
            parts["cpu worker"].append(pid)
        else:
            parts["scheduler" if name == "scheduler" else "rest"].append(pid)
    if dep.redis is not None and dep.redis.proc is not None:
        parts["redis"].append(dep.redis.proc.pid)
    if ENGINE:
        parts.update(engine_parts(ENGINE[0]))
    return parts


def engine_parts(url: str) -> dict[str, list[int]]:
    """A private engine's processes (`tests.fixtures.docker.private_dockerd`: its directory holds
    dockerd's pid file and containerd's socket): `engine`, dockerd (and containerd under it), and
    `shims`, one per container, whose children are the containers' processes. Containers of
    every deployment on the engine count (an idle one's cost next to nothing)."""
    base = url.removeprefix("unix://").rsplit("/", 1)[0]
    try:
        dockerd = [int(Path(base, "dockerd.pid").read_text())]
    except (OSError, ValueError):
        return {}  # not a private engine: its processes are not told apart from others'
    sock = f"{base}/exec/containerd/containerd.sock".encode()
    shims = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and sock in Path(f"/proc/{name}/cmdline").read_bytes():
                shims.append(int(name))
        except OSError:
            continue
    return {"engine": dockerd, "shims": shims}


def _part_cpu(parts: dict[str, list[int]]) -> dict[str, dict[int, float]]:
    """CPU seconds per process of each part (a CPU worker's sandboxes apart from the worker)."""
    table = proc_table()  # one reading of /proc for every part
    out = {
        name: tree_cpu_s(pids, table) for name, pids in parts.items() if name not in ("sandboxes", "shims")
    }
    if "cpu worker" in out:
        worker_pids = set(parts["cpu worker"])
        tree = out["cpu worker"]
        out["sandboxes"] = {p: c for p, c in tree.items() if p not in worker_pids}
        out["cpu worker"] = {p: c for p, c in tree.items() if p in worker_pids}
    shims = set(parts.get("shims", []))
    if shims:  # a container's processes are its shim's children; the shim is the engine's
        tree = tree_cpu_s(list(shims), table)
        out["sandboxes"] = {**out.get("sandboxes", {}), **{p: c for p, c in tree.items() if p not in shims}}
        out["engine"] = {**out.get("engine", {}), **{p: c for p, c in tree.items() if p in shims}}
    return out


def settle(
    parts: dict[str, list[int]], max_s: float = 60.0, window_s: float = 0.5, quiet: float = 0.05
) -> float:
    """Wait until the deployment's processes have used under `quiet` of a core for two windows of
    `window_s` in a row (its ready pool grown, its disposer done), `max_s` at most; the seconds
    waited."""

    def used() -> float:
        return sum(sum(per.values()) for per in _part_cpu(parts).values())

    t0, calm, last = time.monotonic(), 0, used()
    while calm < 2 and time.monotonic() - t0 < max_s:
        time.sleep(window_s)
        now = used()
        calm = calm + 1 if 0 <= now - last < quiet * window_s else 0
        last = now
    return time.monotonic() - t0


def on_demand_starts(dep: Deployment) -> int:
    """Sandboxes the CPU worker has started for an action because none was ready (its log)."""
    log = Path(dep.state_dir) / "logs" / "worker-cpu-local.log"
    return log.read_text(errors="replace").count("started (none ready)") if log.exists() else 0


def first_burst(dep: Deployment, client: TangramClient, problems: list[Problem]) -> dict[str, Any]:
    """The plain harness, then the programs as new trajectories once, on a stack that has just
    started and settled: the first burst, with no idle trajectory to evict."""
    out: dict[str, Any] = {"settle_s": settle(stack_parts(dep))}
    out["plain"] = with_cpu({}, lambda: plain(problems))
    before = on_demand_starts(dep)
    out["fresh"] = with_cpu(stack_parts(dep), lambda: through_client(client, problems, "fresh"))
    out["started_on_demand"] = on_demand_starts(dep) - before
    out["ratio"] = out["fresh"]["wall_s"] / out["plain"]["wall_s"]
    print(
        f"first burst after start: {out['fresh']['wall_s']:.2f} s against {out['plain']['wall_s']:.2f} s "
        f"plain ({out['ratio']:.2f}x), {out['started_on_demand']} sandboxes started on demand"
    )
    return out


def with_cpu(parts: dict[str, list[int]], run: Any) -> dict[str, Any]:
    """`run()`'s result with `cpu_s`: what it cost in CPU, in this process (the client, or the
    plain harness and its interpreters) and in the deployment's processes; and `cpu_parts`, the
    same split by part (`stack_parts`; "client" is this process); and `busy`, the share of the
    machine's CPU time that was not idle meanwhile. A sandbox destroyed during
    the run counts in the CPU worker, which reaps it (recycled ones, the usual case, do not)."""
    before, mine, ticks = _part_cpu(parts), own_cpu_s(), cpu_ticks()
    out: dict[str, Any] = run()
    out["busy"] = busy_between(ticks, cpu_ticks())
    after = _part_cpu(parts)
    split = {name: cpu_between(before.get(name, {}), after[name]) for name in after}
    split["client"] = own_cpu_s() - mine
    out["cpu_s"] = sum(split.values())
    out["cpu_parts"] = split
    return out


def through_client(client: TangramClient, problems: list[Problem], variant: str) -> dict[str, Any]:
    """All programs submitted at once; wall s until the last result; how many passed."""
    tag = os.urandom(3).hex()
    actions = []
    for i, p in enumerate(problems):
        code = p.broken if variant == "broken" else p.reference
        if variant == "one-shot":
            tid = None
        elif variant == "warm":  # for reference: 2 long-lived trajectories, no sandbox starts
            tid = f"warm-{tag}-{i % 2}"
        elif variant == "warm-many":  # the same over as many sandboxes as new trajectories use
            tid = f"warm-many-{tag}-{i % ROTATION}"
        else:
            tid = f"{variant}-{tag}-{p.name}"
        actions.append(
            CodeAction(trajectory_id=tid, code=code, test_cases=p.tests, memory_mb=512, timeout_s=30)
        )
    t0 = time.perf_counter()
    results = [h.result(timeout=900) for h in client.submit_many(actions)]
    wall_s = time.perf_counter() - t0
    return {
        "wall_s": wall_s,
        "passed": sum(r.status is ActionStatus.OK for r in results),
        "statuses": dict(sorted(Counter(str(r.status) for r in results).items())),
        "reset": sum(r.sandbox_reset for r in results),
        "n": len(results),
        "batch_mean": statistics.fmean(r.batch_size for r in results),
        "exec_busy": sum(r.exec_s for r in results) / wall_s / 2,  # share of the 2 cores in actions
    }


def plain(problems: list[Problem], isolated: bool = False) -> dict[str, Any]:
    """2 worker processes, a fresh `python3 -c program+check` per program, no isolation;
    `isolated`: `python3 -I -S -c` (no `site`, no user paths: the interpreter's fastest start)."""
    flags = ["-I", "-S"] if isolated else []

    def one(p: Problem) -> bool:
        test = p.tests[0].assert_code or ""
        r = subprocess.run([PY, *flags, "-c", p.reference + "\n" + test], capture_output=True, timeout=30)
        return r.returncode == 0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        ok = list(pool.map(one, problems))
    return {"wall_s": time.perf_counter() - t0, "passed": sum(ok), "n": len(ok)}


def plot(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4), gridspec_kw={"width_ratios": [1, 2]})
    lat = res["latency"]
    a.bar(
        ["warm trajectory", "new trajectory"],
        [lat["warm_p50_ms"], lat["new_p50_ms"]],
        color=["tab:gray", "tab:blue"],
    )
    a.set_ylabel("p50 client latency (ms)")
    a.set_title("trivial action, one at a time")
    names = ["plain", "fresh", "fresh-occupant", "one-shot", "warm", "warm-many"]
    labels = [
        "plain harness\n(2 procs, python -c)",
        "new trajectories\n(never closed)",
        "the same, a verifier\nper occupant",
        "one-shot",
        "2 warm trajectories\n(reference)",
        f"{ROTATION} warm ones\nin turn",
        "first burst\nafter start",
    ]
    vals = [res["best"][n]["wall_s"] for n in names] + [res["first_burst"]["fresh"]["wall_s"]]
    colors = ["tab:gray", "tab:blue", "tab:cyan", "tab:green", "tab:olive", "tab:brown", "tab:purple"]
    b.bar(labels, vals, color=colors)
    b.tick_params(axis="x", labelsize=7)
    for x, v in enumerate(vals):
        b.text(x, v, f"{v:.2f} s", ha="center", va="bottom")
    b.axhline(0.8 * vals[0], color="tab:red", ls="--", lw=1, label="target: 0.8 x plain")
    b.set_ylim(0, 1.25 * max(vals))  # room for the legend above the bars' labels
    b.set_ylabel("wall time for 164 HumanEval programs (s)")
    b.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"{res['backend']} backend, load avg {res['load_before'][0]:.1f} at start", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="best of this many rounds per variant")
    ap.add_argument("--latency-n", type=int, default=40, help="samples per latency series")
    ap.add_argument("--backend", choices=["namespace", "docker"], default="namespace")
    ap.add_argument("--docker-host", default=None, help="use this engine, not a private one")
    ap.add_argument("--prewarm", type=int, default=2, help="sandbox.prewarm of the deployment")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    problems = humaneval_problems()
    res: dict[str, Any] = {
        "backend": args.backend,
        "programs": len(problems),
        "cores": 2,
        "prewarm": args.prewarm,
        "load_before": list(os.getloadavg()),
        "machine_us_before": machine_us(),
    }
    with contextlib.ExitStack() as stack:
        docker_host = args.docker_host
        if args.backend == "docker" and docker_host is None:
            from benchmarks.sandbox import engine

            docker_host = stack.enter_context(engine(None))
        if args.backend == "docker" and docker_host:
            ENGINE.append(docker_host)
        with (
            deployment(args.backend, docker_host, args.prewarm, ready_idle=0) as bare,
            TangramClient(bare.url) as bare_client,
        ):
            print("without sandboxes started ahead while idle (ready_idle: 0):")
            res["first_burst_without_reserve"] = first_burst(bare, bare_client, problems)
        dep = stack.enter_context(deployment(args.backend, docker_host, args.prewarm))
        client = stack.enter_context(TangramClient(dep.url))
        res["first_burst"] = first_burst(dep, client, problems)
        occ = stack.enter_context(
            deployment(args.backend, docker_host, args.prewarm, verifier_scope="occupant")
        )
        occ_client = stack.enter_context(TangramClient(occ.url))
        through_client(occ_client, problems, "fresh")  # its memory filled: later runs evict, as on dep
        # the deployment a variant runs on, and every process of both (both settle before a run)
        on = {"fresh-occupant": (occ, occ_client)}
        both = {k: v + stack_parts(occ)[k] for k, v in stack_parts(dep).items()}
        settle(both)
        res["latency"] = latency(client, args.latency_n)
        lat = res["latency"]
        print(f"latency p50: warm {lat['warm_p50_ms']:.1f} ms, new trajectory {lat['new_p50_ms']:.1f} ms")
        runs: dict[str, list[dict[str, Any]]] = {
            "plain": [],
            "plain-isolated": [],
            "fresh": [],
            "fresh-occupant": [],
            "one-shot": [],
            "broken": [],
            "warm": [],
            "warm-many": [],
        }
        for r in range(args.rounds):
            for variant in runs:
                settle(both)  # the ready pools refilled, evictions done (a second at least)
                d, c = on.get(variant, (dep, client))
                harness = variant.startswith("plain")
                out = with_cpu(
                    {} if harness else stack_parts(d),
                    (lambda i=variant == "plain-isolated": plain(problems, i))
                    if harness
                    else (lambda v=variant.removesuffix("-occupant"), c=c: through_client(c, problems, v)),
                )
                out["load"] = os.getloadavg()[0]
                runs[variant].append(out)
                print(
                    f"round {r + 1} {variant:9s} {out['wall_s']:6.2f} s  cpu {out['cpu_s']:5.2f} s  "
                    f"passed {out['passed']}/{out['n']}  busy {out['busy']:.2f}  load {out['load']:.1f}  ms/program: "
                    + ", ".join(f"{k} {1000 * c / len(problems):.1f}" for k, c in out["cpu_parts"].items())
                )
        log = "".join(
            (Path(d.state_dir) / "logs" / "scheduler.log").read_text(errors="replace") for d in (dep, occ)
        )
        res["scheduler_stalls_logged"] = log.count("no progress")
        res["evictions_logged"] = sum(int(n) for n in re.findall(r"evicted (\d+) idle", log))
        res["cpu_batch_joins"] = dep.counter("scheduler", "tangram_cpu_batch_joins_total")
    res["runs"] = runs
    res["best"] = {v: min(rs, key=lambda x: x["wall_s"]) for v, rs in runs.items()}
    res["median_wall_s"] = {v: statistics.median(x["wall_s"] for x in rs) for v, rs in runs.items()}
    # how busy the machine's cores were during each variant's runs (median): the plain harness
    # keeps both busy; the stack's share that is idle is waiting between its steps
    res["busy_median"] = {v: statistics.median(x["busy"] for x in rs) for v, rs in runs.items()}
    # CPU per program (all processes: client or harness, Redis, scheduler, workers, sandboxes):
    # what the wall time would be on 2 idle cores at full use, and barely moved by other jobs
    # (Docker: its containers and its engine counted, `engine_parts`)
    res["cpu_ms_per_program"] = {
        v: 1000 * statistics.median(x["cpu_s"] for x in rs) / len(problems) for v, rs in runs.items()
    }
    res["cpu_ms_per_program_by_part"] = {
        v: {
            part: 1000 * statistics.median(x["cpu_parts"][part] for x in rs) / len(problems)
            for part in rs[0]["cpu_parts"]
        }
        for v, rs in runs.items()
    }
    res["cpu_ratio_fresh_vs_plain"] = res["cpu_ms_per_program"]["fresh"] / res["cpu_ms_per_program"]["plain"]
    res["cpu_ratio_fresh_vs_plain_isolated"] = (
        res["cpu_ms_per_program"]["fresh"] / res["cpu_ms_per_program"]["plain-isolated"]
    )
    plain_s = res["best"]["plain"]["wall_s"]
    # The same ratios paired by round (each variant's run against the plain harness's run just
    # before it), median over the rounds: the machine's speed drifts over minutes, and a pair
    # run back to back sees nearly the same machine, where the best of each may not.
    res["paired_ratio_vs_plain"] = {
        v: statistics.median(x["wall_s"] / p["wall_s"] for x, p in zip(runs[v], runs["plain"], strict=True))
        for v in THROUGH_STACK
    }
    res["paired_ratio_vs_plain_isolated"] = {  # against `python3 -I -S -c` (issue 36's yardstick)
        v: statistics.median(
            x["wall_s"] / p["wall_s"] for x, p in zip(runs[v], runs["plain-isolated"], strict=True)
        )
        for v in THROUGH_STACK
    }
    res["ratio_fresh_vs_plain_isolated"] = (
        res["best"]["fresh"]["wall_s"] / res["best"]["plain-isolated"]["wall_s"]
    )
    res["ratio_fresh_vs_plain"] = res["best"]["fresh"]["wall_s"] / plain_s
    res["ratio_fresh_occupant_vs_plain"] = res["best"]["fresh-occupant"]["wall_s"] / plain_s
    res["ratio_one_shot_vs_plain"] = res["best"]["one-shot"]["wall_s"] / plain_s
    res["ratio_warm_vs_plain"] = res["best"]["warm"]["wall_s"] / plain_s
    res["ratio_warm_many_vs_plain"] = res["best"]["warm-many"]["wall_s"] / plain_s
    res["rotation"] = ROTATION
    res["load_after"] = list(os.getloadavg())
    res["machine_us_after"] = machine_us()
    n = len(problems)
    res["checks"] = {
        "all_references_pass": all(x["passed"] == n for v in THROUGH_STACK for x in runs[v]),
        "all_broken_fail": all(x["passed"] == 0 for x in runs["broken"]),
        "plain_all_pass": all(x["passed"] == n for x in runs["plain"]),
        "new_within_5_ms_of_warm": res["latency"]["new_minus_warm_p50_ms"] <= 5.0,
        "fresh_at_most_0.8x_plain": res["ratio_fresh_vs_plain"] <= 0.8,
        "fresh_at_most_1.0x_plain_isolated_paired": res["paired_ratio_vs_plain_isolated"]["fresh"] <= 1.0,
        "first_burst_all_pass": res["first_burst"]["fresh"]["passed"] == n,
        "first_burst_started_no_sandbox_on_demand": res["first_burst"]["started_on_demand"] == 0,
    }
    paired = res["paired_ratio_vs_plain"]
    print(
        f"fresh / plain = {res['ratio_fresh_vs_plain']:.2f}x, one-shot / plain = {res['ratio_one_shot_vs_plain']:.2f}x, "
        f"fresh with a verifier per occupant / plain = {res['ratio_fresh_occupant_vs_plain']:.2f}x (best of each); "
        f"paired by round (median): fresh {paired['fresh']:.2f}x, one-shot {paired['one-shot']:.2f}x, "
        f"fresh with a verifier per occupant {paired['fresh-occupant']:.2f}x"
    )
    iso = res["paired_ratio_vs_plain_isolated"]
    print(
        f"against python3 -I -S -c: fresh {res['ratio_fresh_vs_plain_isolated']:.2f}x best of each, "
        f"{iso['fresh']:.2f}x paired (median); one-shot {iso['one-shot']:.2f}x paired"
    )
    cpu = res["cpu_ms_per_program"]
    if cpu:
        print(
            f"CPU ms per program: plain {cpu['plain']:.1f} (-I -S {cpu['plain-isolated']:.1f}), "
            f"new trajectories {cpu['fresh']:.1f}, "
            f"{ROTATION} warm ones in turn {cpu['warm-many']:.1f}, 2 warm ones {cpu['warm']:.1f}"
        )
    print(f"checks: {res['checks']}; load {res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f}")
    name = "stateless" if args.backend == "namespace" else f"stateless_{args.backend}"
    path = write_json(name, res)
    plot(res, RESULTS / f"{name}.png")
    print(f"wrote {path}")
    ok = all(res["checks"][k] for k in ("all_references_pass", "all_broken_fail", "first_burst_all_pass"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
