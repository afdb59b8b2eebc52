"""Stateless callers at the sandbox API: a new trajectory's first action and a one-shot action
against an action in a warm trajectory sandbox, side by side in one run.

No scheduler, broker or worker: `open_sandbox` (namespace backend, 2 ready sandboxes) as a CPU
worker holds it, so that only the sandbox layer is measured.

1. latency, one action at a time, every variant once per round in a shuffled order (before
   each action the background refill and scrubs have finished, then a think time passes):
   - warm: an action in an existing trajectory sandbox;
   - fresh: the first action of a new trajectory in a ready sandbox that never ran code (a
     backend with `recycle: false`: the pool refills by starting sandboxes, as when nothing is
     closed);
   - recycled: the first action of a new trajectory in a ready sandbox a closed trajectory
     left (scrubbed); the trajectory is closed after its action, as an eviction does;
   - one-shot: `run_once` (a ready sandbox, scrubbed and recycled afterwards);
   each for a HumanEval program (reference + its assert test, `tests/problems`) and a trivial
   `pass`, on core 0. p50/p90/mean of wall ms per call. Target: p50 within 1 ms of warm.
2. throughput: the 164 HumanEval programs on 2 threads (one on core 0, one on core 1) as 164
   new trajectories, each closed after its action (what the worker's eviction does to a
   never-closed trajectory), against the same programs over 2 warm trajectories (one per
   thread), and as 164 one-shot actions; rounds alternate, best and median wall time of each.
   Target: new trajectories within 10% of 2 warm trajectories. The CPU time of the worker's
   process and of the sandboxes' processes per program is recorded too (what each variant
   costs the cores, whatever the load of others).
3. requests: what talking to a runner costs, a `ping` at a time to one ready sandbox, over the
   connection the host keeps for the sandbox (`RunnerLink`, what actions and scrubs use) against
   a connection per request (`call_runner`, what all requests used before); rounds alternate.
   Host CPU (this process) and runner CPU (the sandbox's cgroup) per request, median of rounds.
The load average is recorded with every section: the machine is shared.

Run: .venv/bin/python benchmarks/stateless_sandbox.py [--rounds 60] [--tp-rounds 5] [--name N]
Writes benchmarks/results/stateless_sandbox.json and stateless_sandbox.png (N.json, N.png).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, percentile, write_json
from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.config import SandboxConfig
from tangram_celery.sandbox import ExecRequest, Sandbox, open_sandbox
from tests.problems import Problem, humaneval_problems

VARIANTS = ("warm", "fresh", "recycled", "one-shot")
KINDS = ("humaneval", "trivial")


def request(p: Problem | None, core: int) -> ExecRequest:
    """A HumanEval program with its assert test, or `pass` (p None), on one core."""
    if p is None:
        return ExecRequest(language="python", code="pass", cores=(core,), memory_mb=512, timeout_s=30)
    return ExecRequest(
        language="python", code=p.reference, test_cases=p.tests, cores=(core,), memory_mb=512, timeout_s=30
    )


def load() -> float:
    return round(os.getloadavg()[0], 2)


def summary(ms: list[float]) -> dict[str, float]:
    return {
        "p50_ms": percentile(ms, 0.5),
        "p90_ms": percentile(ms, 0.9),
        "mean_ms": statistics.fmean(ms),
        "n": len(ms),
    }


def settle(*boxes: Any, pause_s: float = 0.3, timeout_s: float = 30.0) -> None:
    """Until every ready pool is full and nothing is being scrubbed or started, then `pause_s`
    (the runner primes a verifier after answering a scrub)."""
    deadline = time.monotonic() + timeout_s
    for box in boxes:
        box.ready.wait_full(max(0.1, deadline - time.monotonic()))
    time.sleep(pause_s)


def latency(
    rec: Sandbox, fresh: Sandbox, problems: list[Problem], rounds: int, think_s: float
) -> dict[str, Any]:
    """Wall ms per call of each variant and kind, alternating; the first 3 rounds warm up."""
    ms: dict[str, dict[str, list[float]]] = {k: {v: [] for v in VARIANTS} for k in KINDS}
    tag = uuid.uuid4().hex[:6]
    warm_tid = f"warm-{tag}"

    def call(variant: str, p: Problem | None) -> Callable[[], Any]:
        req = request(p, 0)
        if variant == "warm":
            return lambda: rec.run(warm_tid, req)
        if variant == "one-shot":
            return lambda: rec.run_once(req)
        box = rec if variant == "recycled" else fresh
        tid = f"{variant}-{tag}-{uuid.uuid4().hex[:8]}"
        return lambda: (box.run(tid, req), box.close_trajectory(tid))[0]

    assert rec.run(warm_tid, request(None, 0)).status is ActionStatus.OK
    settle(rec, fresh)
    counters0: dict[str, int] = {}
    order = [(k, v) for k in KINDS for v in VARIANTS]
    shuffle = random.Random(12).shuffle
    for r in range(rounds + 3):
        if r == 3:
            counters0 = {"fresh_started": fresh.ready.started, "recycled_started": rec.ready.started}
        p = problems[r % len(problems)]
        shuffle(order)  # a new order each round: no variant always follows the same one
        for kind, variant in order:
            fn = call(variant, p if kind == "humaneval" else None)
            t0 = time.perf_counter()
            res = fn()
            took = (time.perf_counter() - t0) * 1000
            assert res.status is ActionStatus.OK and not res.sandbox_reset, (variant, kind, res)
            if r >= 3:
                ms[kind][variant].append(took)
            # the caller's think time, after the refill or scrub this action caused is done:
            # each sample sees the same quiet pools
            settle(rec, fresh, pause_s=think_s)
    out: dict[str, Any] = {k: {v: summary(ms[k][v]) for v in VARIANTS} for k in KINDS}
    for k in KINDS:
        warm = out[k]["warm"]["p50_ms"]
        out[k]["minus_warm_p50_ms"] = {v: out[k][v]["p50_ms"] - warm for v in VARIANTS if v != "warm"}
    # with recycling and a think time, no sandbox should be started for the recycled variant
    out["sandboxes_started_while_measuring"] = {
        "fresh_backend": fresh.ready.started - counters0["fresh_started"],
        "recycling_backend": rec.ready.started - counters0["recycled_started"],
    }
    out["rounds"], out["think_s"] = rounds, think_s
    return out


def cpu_s(box: Any) -> float:
    """CPU seconds used so far by this process (the worker's side) and by the processes in the
    backend's sandbox cgroups (runners, zygotes and, once reaped, their children: user processes
    and verifiers). Clock ticks: meaningful over many actions."""
    from tangram_celery.sandbox import cgroups

    tick = os.sysconf("SC_CLK_TCK")
    t = os.times()
    total = t.user + t.system
    for name in cgroups.children(box.who.prefix):
        cg = cgroups.CgroupSet.existing(name)
        for pid in cg.procs() if cg is not None else []:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    return total


def through(box: Sandbox, problems: list[Problem], variant: str, tag: str) -> dict[str, Any]:
    """The programs on 2 threads (cores 0 and 1): wall s, CPU ms per program, how many passed."""
    nxt = iter(range(len(problems)))
    lock = threading.Lock()
    passed = [0, 0]

    def worker(k: int) -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            req = request(problems[i], k)
            if variant == "warm":
                res = box.run(f"tp-warm-{tag}-{k}", req)
            elif variant == "one-shot":
                res = box.run_once(req)
            else:  # a new trajectory, closed after its action (as an eviction does)
                tid = f"tp-new-{tag}-{i}"
                res = box.run(tid, req)
                box.close_trajectory(tid)
            passed[k] += res.status is ActionStatus.OK

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    c0, t0 = cpu_s(box), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall_s = time.perf_counter() - t0
    settle(box)  # the scrubs this variant caused are part of its cost
    cpu_ms = (cpu_s(box) - c0) * 1000 / len(problems)
    return {
        "wall_s": wall_s,
        "cpu_ms_per_program": cpu_ms,
        "passed": sum(passed),
        "n": len(problems),
        "load": load(),
    }


def throughput(box: Sandbox, problems: list[Problem], rounds: int) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]
    names = ("warm", "new", "one-shot")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for k in (0, 1):  # the 2 warm trajectories exist before the first round
        assert box.run(f"tp-warm-{tag}-{k}", request(None, k)).status is ActionStatus.OK
    for r in range(rounds):
        for variant in names[r % 3 :] + names[: r % 3]:
            settle(box)
            out = through(box, problems, variant, tag)
            runs[variant].append(out)
            print(
                f"  round {r + 1} {variant:8s} {out['wall_s']:.2f} s, {out['cpu_ms_per_program']:.1f} ms CPU "
                f"per program, {out['passed']}/{out['n']} passed, load {out['load']}"
            )
    best = {n: min(x["wall_s"] for x in runs[n]) for n in names}
    median = {n: statistics.median(x["wall_s"] for x in runs[n]) for n in names}
    cpu = {n: statistics.median(x["cpu_ms_per_program"] for x in runs[n]) for n in names}
    return {
        "rounds": rounds,
        "runs": runs,
        "best_wall_s": best,
        "median_wall_s": median,
        "ratio_new_vs_warm_best": best["new"] / best["warm"],
        "ratio_new_vs_warm_median": median["new"] / median["warm"],
        "ratio_one_shot_vs_warm_best": best["one-shot"] / best["warm"],
        "median_cpu_ms_per_program": cpu,
        "ratio_new_vs_warm_cpu": cpu["new"] / cpu["warm"],
        "all_passed": all(x["passed"] == x["n"] for rs in runs.values() for x in rs),
    }


def requests(box: Any, n: int, rounds: int) -> dict[str, Any]:
    """Section 3 of the module doc."""
    from tangram_celery.sandbox.link import call_runner

    assert box.ready.wait_full(60)
    h = box.ready.take()
    ways: dict[str, Callable[[], Any]] = {
        "kept": lambda: h.call({"op": "ping"}, 5.0),
        "per-request": lambda: call_runner(h.socket_path, {"op": "ping"}, 5.0),
    }
    got: dict[str, dict[str, list[float]]] = {
        w: {"host_us": [], "runner_us": [], "wall_us": []} for w in ways
    }
    try:
        for r in range(rounds):
            for way in sorted(ways, reverse=r % 2 == 1):
                c0, t0, w0 = h.cgroups.counters()["cpu_us"], time.process_time(), time.monotonic()
                for _ in range(n):
                    assert ways[way]().get("pong")
                c1, t1, w1 = h.cgroups.counters()["cpu_us"], time.process_time(), time.monotonic()
                got[way]["host_us"].append((t1 - t0) / n * 1e6)
                got[way]["runner_us"].append((c1 - c0) / n)
                got[way]["wall_us"].append((w1 - w0) / n * 1e6)
    finally:
        box._teardown(h)
    out: dict[str, Any] = {"requests_per_round": n, "rounds": rounds}
    for way, series in got.items():
        out[way] = {k: round(statistics.median(v), 1) for k, v in series.items()}
    out["saved_us_per_request"] = round(
        sum(out["per-request"][k] - out["kept"][k] for k in ("host_us", "runner_us")), 1
    )
    return out


def plot(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4), gridspec_kw={"width_ratios": [2, 2, 1]})
    lat = res["latency"]
    width = 0.38
    for j, kind in enumerate(KINDS):
        xs = [i + j * width for i in range(len(VARIANTS))]
        vals = [lat[kind][v]["p50_ms"] for v in VARIANTS]
        a.bar(xs, vals, width=width, label=f"{kind}")
        for x, v in zip(xs, vals, strict=True):
            a.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
    a.set_xticks([i + width / 2 for i in range(len(VARIANTS))], list(VARIANTS))
    a.set_ylabel("p50 wall ms per call")
    a.set_title("one action at a time, core 0")
    a.legend(fontsize=8)
    tp = res["throughput"]
    names = ["warm", "new", "one-shot"]
    vals = [tp["best_wall_s"][n] for n in names]
    labels = ["2 warm trajectories", "164 new trajectories\n(closed after)", "164 one-shot"]
    b.bar(labels, vals, color=["tab:gray", "tab:blue", "tab:green"])
    for x, v in enumerate(vals):
        b.text(x, v, f"{v:.2f} s", ha="center", va="bottom")
    b.axhline(1.1 * vals[0], color="tab:red", ls="--", lw=1, label="target: 1.1 x warm")
    b.set_ylabel("best wall s, 164 HumanEval programs, 2 threads")
    b.legend(loc="lower right", fontsize=8)
    rq = res["requests"]
    ways = ["per-request", "kept"]
    host = [rq[w]["host_us"] for w in ways]
    runner = [rq[w]["runner_us"] for w in ways]
    c.bar(ways, host, label="host", color="tab:gray")
    c.bar(ways, runner, bottom=host, label="runner", color="tab:blue")
    for x, (hv, rv) in enumerate(zip(host, runner, strict=True)):
        c.text(x, hv + rv, f"{hv + rv:.0f}", ha="center", va="bottom", fontsize=8)
    c.set_ylabel("CPU us per request (median of rounds)")
    c.set_title("a ping to one runner: connection")
    c.legend(fontsize=8)
    fig.suptitle(
        f"sandbox API, namespace backend; load avg {res['load_start']} at start, {res['load_end']} at end",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60, help="latency samples per variant and kind")
    ap.add_argument("--tp-rounds", type=int, default=5, help="throughput rounds per variant")
    ap.add_argument("--think", type=float, default=0.12, help="s between latency samples")
    ap.add_argument("--req-n", type=int, default=2000, help="pings per round (section 3)")
    ap.add_argument("--req-rounds", type=int, default=6, help="rounds per way (section 3)")
    ap.add_argument("--name", default="stateless_sandbox", help="results/<name>.json and .png")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    problems = humaneval_problems()
    res: dict[str, Any] = {"load_start": load(), "cpus": os.cpu_count(), "programs": len(problems)}
    rec = open_sandbox(SandboxConfig(backend="namespace", prewarm=2))
    try:
        fresh = open_sandbox(SandboxConfig(backend="namespace", prewarm=2, recycle=False))
        try:
            res["launcher"] = getattr(rec, "launcher", "")
            res["latency_load_start"] = load()
            res["latency"] = latency(rec, fresh, problems, args.rounds, args.think)
            res["latency_load_end"] = load()
        finally:
            fresh.close()
        for kind in KINDS:
            lat = res["latency"][kind]
            print(
                f"{kind:9s} p50 ms: "
                + ", ".join(f"{v} {lat[v]['p50_ms']:.1f}" for v in VARIANTS)
                + f" (load {res['latency_load_end']})"
            )
        res["throughput_load_start"] = load()
        res["throughput"] = throughput(rec, problems, args.tp_rounds)
        res["throughput_load_end"] = load()
        res["requests"] = requests(rec, args.req_n, args.req_rounds)
    finally:
        rec.close()
    res["load_end"] = load()
    tp = res["throughput"]
    res["checks"] = {
        "all_passed": tp["all_passed"],
        "new_and_one_shot_within_1_ms_of_warm": all(
            res["latency"][k]["minus_warm_p50_ms"][v] <= 1.0
            for k in KINDS
            for v in ("fresh", "recycled", "one-shot")
        ),
        "new_trajectories_within_10_percent_of_warm": tp["ratio_new_vs_warm_best"] <= 1.1,
    }
    print(
        f"throughput best: warm {tp['best_wall_s']['warm']:.2f} s, new {tp['best_wall_s']['new']:.2f} s "
        f"({tp['ratio_new_vs_warm_best']:.2f}x), one-shot {tp['best_wall_s']['one-shot']:.2f} s; "
        f"load {res['load_start']} -> {res['load_end']}"
    )
    rq = res["requests"]
    print(
        "CPU us per request (host + runner): "
        + ", ".join(f"{w} {rq[w]['host_us']:.0f} + {rq[w]['runner_us']:.0f}" for w in ("per-request", "kept"))
    )
    print(f"checks: {res['checks']}")
    path = write_json(args.name, res)
    plot(res, RESULTS / f"{args.name}.png")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
