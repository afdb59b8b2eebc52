"""Soak: mixed load for a long time with periodic random SIGKILLs; every action is accounted for.

Trajectories cycle through four actions, each with an answer known in advance:
- a code action printing a sum of squares (exact stdout);
- a code action with a test suite (`test_cases`, assert snippets), one test in three made to fail
  on purpose (exact per-test verdicts and status);
- a reward action on a rule verifier (exact-match or math-equiv, matching or not: score 1 or 0);
- an API call that appends its tag to a log (its answer is the tag; every execution is counted).
A killer SIGKILLs, at random, the scheduler, the CPU worker (which also runs the rule
verifiers), the API worker, or Redis (restarted from its AOF). Just before each kill it reads,
from Redis, the state of every action in flight (queued, dispatched, or running and on which
worker), so that the result table says which kills hit running work and what became of it.

At the end, per kind (benchmarks/soak_check.py): submitted, completed, lost (no result), wrong
(an output that does not verify), duplicated completions (two records in the scheduler's run log
or two results pushed to the client), duplicated API executions, the attempts histogram (above 1:
run again after a kill), ACT percentiles; and the kills table.

With `--tenants N` the trajectories are spread over N tenants made as `tangram tenant add` makes
them (issue 37): each tenant's client has its own Redis user, and the tenants use the same
trajectory ids, so a mix-up between them shows as a wrong output.

Run: .venv/bin/python benchmarks/soak.py --minutes 30 [--kill-every-s 60] [--trajectories 16] [--tenants 3]
Writes benchmarks/results/soak.json and soak.png. Exit status 1 if anything was lost, wrong or
duplicated, or if a client call raised anything but Tangram's own errors (`client_errors`: a
caller could not have handled it; the trajectory's thread ends there).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, write_json
from benchmarks.soak_check import VICTIMS, Expected, InFlight, Kill, summarize
from tangram_celery import ActionResult, ApiAction, CodeAction, RewardAction, TangramClient
from tangram_celery.common.actions import TestCase
from tangram_celery.common.config import parse_config
from tangram_celery.common.errors import TangramError
from tangram_celery.common.tenants import DEFAULT, local, prefix
from tangram_celery.deploy import Deployment, write_config
from tangram_celery.testing import tenant_url

logger = logging.getLogger("soak")

# pairs for the rule verifiers: (rule, response, reference, expected score)
RULE_CASES = [
    ("exact", "Paris", "paris", 1.0),
    ("exact", "Lyon", "Paris", 0.0),
    ("math", "\\frac{1}{2}", "0.5", 1.0),
    ("math", "\\boxed{3}", "4", 0.0),
]


def config(tmp: Path) -> Any:
    return parse_config(
        {
            "state_dir": str(tmp / "state"),
            "nodes": {"cpu": [{"name": "n0", "cores": 2, "memory_mb": 8192}]},
            "apis": [{"name": "rec", "handler": "tests.integration.support:record", "max_concurrency": 4}],
            "reward_models": [
                {"name": "exact", "backend": "rule", "rule": "exact-match"},
                {"name": "math", "backend": "rule", "rule": "math-equiv"},
            ],
            "sandbox": {"backend": "auto", "idle_ttl_s": 30},
        }
    )


def make_action(
    k: int, step: int, tid: str, rng: random.Random, log: Path
) -> tuple[CodeAction | RewardAction | ApiAction, Expected]:
    """The trajectory's `step`-th action and what it must return."""
    which = step % 4
    if which == 0:
        n = rng.randint(1, 200_000)
        code = f"print(sum(i * i for i in range({n})))"
        want = f"{sum(i * i for i in range(n))}\n"
        return CodeAction(trajectory_id=tid, code=code, memory_mb=128), Expected("code", stdout=want)
    if which == 1:
        tag = f"{k}-{step}"
        action = ApiAction(trajectory_id=tid, api="rec", request={"tag": tag, "log": str(log)})
        return action, Expected("api", tag=tag)
    if which == 2:
        m = rng.randint(2, 9)
        bad = rng.random() < 1 / 3
        tests = {"t_two": True, "t_three": not bad}
        cases = [
            TestCase(name="t_two", assert_code=f"assert f(2) == {2 * m}"),
            TestCase(name="t_three", assert_code=f"assert f(3) == {3 * m + (1 if bad else 0)}"),
        ]
        code = f"def f(x):\n    return x * {m}\n"
        action = CodeAction(trajectory_id=tid, code=code, test_cases=cases, memory_mb=128)
        return action, Expected("code", status="failed" if bad else "ok", tests=tests)
    rule, response, reference, score = RULE_CASES[rng.randrange(len(RULE_CASES))]
    action = RewardAction(  # type: ignore[assignment]
        trajectory_id=tid, model=rule, inputs={"response": response, "reference": reference}
    )
    return action, Expected("reward", status="ok", score=score)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--kill-every-s", type=float, default=60.0)
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drain-s", type=float, default=180.0, help="wait for in-flight results at the end")
    ap.add_argument("--out", default="soak", help="result file name under benchmarks/results/")
    ap.add_argument("--tenants", type=int, default=0, help="spread the trajectories over N named tenants")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="tangram-soak-"))
    cfg = config(tmp)
    dep = Deployment(cfg, write_config(cfg, tmp / "soak.yaml"), with_flower=False)
    dep.start()
    import redis as redis_lib

    names = [f"soak{n}" for n in range(args.tenants)]
    urls = [tenant_url(dep.url, name) for name in names] or [dep.url]
    tenant_of = (lambda k: names[k % len(names)]) if names else (lambda k: DEFAULT)
    owner: dict[str, str] = {}  # action id -> its tenant

    log = tmp / "executions.log"
    expected: dict[str, Expected] = {}
    results: dict[str, dict[str, Any]] = {}
    in_flight: dict[str, str] = {}  # action id -> kind
    by_time: list[tuple[float, str]] = []  # (submitted at, id)
    submit_errors: list[str] = []
    client_errors: list[str] = []  # a call that raised what a caller cannot handle: a client bug
    lock = threading.Lock()
    stop = threading.Event()
    kills: list[Kill] = []
    t_start = time.monotonic()

    def trajectory(k: int) -> None:
        try:
            drive(k)
        except Exception as e:  # the thread ends: its action in flight counts as lost too
            logger.exception("trajectory %d died", k)
            with lock:
                client_errors.append(f"trajectory {k}: {e!r}")

    def drive(k: int) -> None:
        client = TangramClient(urls[k % len(urls)])
        trng = random.Random(rng.random())
        step = 0
        while not stop.is_set():
            # a new trajectory every 12 steps; tenants use the same names
            tid = f"soak-{k // len(urls)}-{step // 12}"
            action, exp = make_action(k, step, tid, trng, log)
            with lock:
                expected[action.id] = exp
                owner[action.id] = tenant_of(k)
                in_flight[action.id] = exp.kind
                by_time.append((time.monotonic() - t_start, action.id))
            try:
                handle = client.submit(action)
            except TangramError as e:  # refused before it was enqueued: not lost, but say so
                with lock:
                    submit_errors.append(f"{action.id}: {e}")
                    del expected[action.id], in_flight[action.id]
                stop.wait(1.0)
                continue
            res: ActionResult | None = None
            while res is None:
                try:
                    res = handle.result(timeout=60)
                except TangramError:
                    if stop.is_set() and time.monotonic() > drain_deadline[0]:
                        break
            if res is None:
                break  # lost: left in in_flight, counted below
            with lock:
                results[action.id] = {**res.model_dump(mode="json"), "received_s": time.monotonic() - t_start}
                in_flight.pop(action.id, None)
            if step % 12 == 11:
                client.close_trajectory(tid)
            step += 1
            stop.wait(trng.uniform(0.0, 0.2))
        client.close()

    def snapshot() -> list[InFlight]:
        """Every action in flight and its state in Redis, read just before a kill."""
        with lock:
            ids = dict(in_flight)
        r = redis_lib.Redis.from_url(dep.url, decode_responses=True, socket_timeout=5)
        try:
            pipe = r.pipeline(transaction=False)
            for i in ids:
                pipe.hmget(f"{prefix(owner[i])}a:{i}", "state", "worker", "attempt")
            rows = pipe.execute()
        finally:
            r.close()
        return [
            InFlight(i, kind, str(s or "unknown"), str(w or ""), int(a or 0))
            for (i, kind), (s, w, a) in zip(ids.items(), rows, strict=True)
        ]

    def killer() -> None:
        krng = random.Random(args.seed + 1)
        while not stop.wait(args.kill_every_s * krng.uniform(0.5, 1.5)):
            v = krng.choice(list(VICTIMS))
            try:
                flight = snapshot()
            except Exception as e:  # Redis may still be restarting: kill anyway, say so
                print(f"  snapshot failed: {e}", flush=True)
                flight = []
            kills.append(Kill(time.monotonic() - t_start, v, flight))
            running = sum(1 for a in flight if a.state == "running")
            print(
                f"  [{time.monotonic() - t_start:7.1f}s] SIGKILL {v} ({len(flight)} in flight, {running} running)",
                flush=True,
            )
            if v == "redis":
                assert dep.redis is not None
                dep.redis.kill()
                time.sleep(1.0)
                dep.redis.restart()
            else:
                dep.kill(v)

    drain_deadline = [float("inf")]
    threads = [threading.Thread(target=trajectory, args=(k,), daemon=True) for k in range(args.trajectories)]
    for t in threads:
        t.start()
    kt = threading.Thread(target=killer, daemon=True)
    kt.start()
    end = t_start + args.minutes * 60
    leftover: dict[str, int] = {}
    try:
        while time.monotonic() < end:
            time.sleep(min(30.0, max(0.1, end - time.monotonic())))
            with lock:
                print(
                    f"  [{time.monotonic() - t_start:7.1f}s] submitted {len(expected)}, completed {len(results)}",
                    flush=True,
                )
        drain_deadline[0] = time.monotonic() + args.drain_s
        stop.set()
        kt.join(timeout=60)
        for t in threads:
            t.join(timeout=max(1.0, drain_deadline[0] + 70 - time.monotonic()))
        r = redis_lib.Redis.from_url(dep.url, decode_responses=True)
        with lock:
            ids = list(results)
        pipe = r.pipeline(transaction=False)
        for i in ids:
            pipe.llen(f"{prefix(owner[i])}n:{i}")
        leftover = {i: int(n) for i, n in zip(ids, pipe.execute(), strict=True) if n}
        r.close()
    finally:
        stop.set()
        dep.stop()

    run_log = [json.loads(x) for x in (Path(cfg.state_dir) / "actions.jsonl").read_text().splitlines() if x]
    for rec in run_log:  # the scheduler logs tenants' ids qualified (`<tenant>/<id>`)
        rec["action_id"] = local(str(rec.get("action_id", "")))
    executions = [x for x in log.read_text().split("\n") if x] if log.exists() else []
    with lock:
        summary = summarize(expected, results, run_log, executions, leftover, kills)
    totals = summary["totals"]
    acts = [(t, results[i]["act_s"]) for t, i in by_time if i in results]
    third = max(1, len(acts) // 3)
    first = sorted(a for _, a in acts[:third])
    last = sorted(a for _, a in acts[-third:])
    p99_first = first[min(len(first) - 1, int(0.99 * len(first)))] if first else None
    p99_last = last[min(len(last) - 1, int(0.99 * len(last)))] if last else None
    data = {
        "policy": {"name": cfg.scheduler.policy, "params": {}},
        "minutes": args.minutes,
        "kill_every_s": args.kill_every_s,
        "trajectories": args.trajectories,
        "tenants": args.tenants,
        "seed": args.seed,
        "sandbox_backend": cfg.sandbox.backend,
        "submit_errors": submit_errors[:20],
        "client_errors": client_errors[:20],
        "leftover_notifications": dict(sorted(leftover.items())[:20]),
        "p99_act_s_first_third": p99_first,
        "p99_act_s_last_third": p99_last,
        "p99_drift": p99_last / p99_first if p99_first and p99_last else None,
        **summary,
    }
    write_json(args.out, data)
    plot(acts, kills, RESULTS / f"{args.out}.png")
    print(
        json.dumps(
            {"totals": totals, "submit_errors": len(submit_errors), "client_errors": client_errors},
            indent=1,
        )
    )
    for kind, row in summary["kinds"].items():
        print(
            f"{kind:6s} submitted {row['submitted']}, completed {row['completed']}, lost {row['lost']}, "
            f"wrong {row['wrong']}, dup completions {row['duplicated_completions']}, "
            f"dup executions {row['duplicated_executions']}, attempts {row['attempts_histogram']}, "
            f"ACT p50 {row['act_s']['p50']}, p99 {row['act_s']['p99']}"
        )
    bad = (
        totals["lost"]
        + totals["wrong"]
        + totals["duplicated_completions"]
        + (totals["duplicated_executions"] or 0)
        + len(client_errors)
    )
    return 0 if bad == 0 else 1


def plot(acts: list[tuple[float, float]], kills: list[Kill], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot([t for t, _ in acts], [a for _, a in acts], ".", ms=2, alpha=0.5)
    colors = {"scheduler": "C3", "worker-cpu-n0": "C1", "worker-api-rec": "C2", "redis": "C4"}
    for victim, color in colors.items():
        ts = [k.t_s for k in kills if k.victim == victim]
        for n, t in enumerate(ts):
            ax.axvline(t, color=color, lw=0.8, alpha=0.7, label=f"kill {victim}" if n == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("submitted at (s)")
    ax.set_ylabel("ACT (s)")
    ax.set_title(f"soak: {len(kills)} random SIGKILLs")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
