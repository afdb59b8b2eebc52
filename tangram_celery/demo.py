"""The demo workload: agentic coding trajectories against a running deployment.

Each trajectory solves one problem over several turns, like an agent would: it probes its code
(tool executions), sometimes calls an API, submits a first (often buggy) attempt, and finishes
with an elastic test-suite action (`cpus='1..N'`). Trajectories run concurrently; every turn
waits for the previous one's result, as a real rollout does.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tangram_celery.actions import ActionResult, ApiAction, CodeAction, TestCase
from tangram_celery.client import TangramClient
from tangram_celery.config import TangramConfig
from tangram_celery.demo_problems import PROBLEMS, Problem
from tangram_celery.errors import TangramError


@dataclass
class Summary:
    results: list[ActionResult] = field(default_factory=list)
    lost: int = 0
    wall_s: float = 0.0

    def report(self) -> str:
        acts = sorted(r.act_s for r in self.results)
        if not acts:
            return "no actions completed"
        q = statistics.fmean(r.queue_s for r in self.results)
        e = statistics.fmean(r.exec_s for r in self.results)
        by_status = Counter(str(r.status) for r in self.results)
        p99 = acts[min(len(acts) - 1, int(0.99 * len(acts)))]
        lines = [
            f"actions: {len(self.results)} completed, {self.lost} lost, in {self.wall_s:.1f} s "
            f"({len(self.results) / max(self.wall_s, 1e-9):.1f} actions/s)",
            "by status: " + ", ".join(f"{k}={v}" for k, v in sorted(by_status.items())),
            f"ACT: mean {statistics.fmean(acts) * 1000:.0f} ms, p50 {acts[len(acts) // 2] * 1000:.0f} ms, "
            f"p99 {p99 * 1000:.0f} ms",
            f"split: queue {q * 1000:.0f} ms + exec {e * 1000:.0f} ms on average "
            f"({100 * q / max(q + e, 1e-9):.0f}% queueing)",
        ]
        tests = [r for r in self.results if r.tests]
        if tests:
            solved = sum(all(t.passed for t in r.tests) for r in tests)
            lines.append(f"final test suites: {solved}/{len(tests)} passed")
        return "\n".join(lines)


def _trajectory(
    client: TangramClient,
    tid: str,
    problem: Problem,
    turns: int,
    max_cpus: int,
    apis: list[str],
    rng: random.Random,
    sink: Callable[[ActionResult], None],
) -> None:
    def run(action: CodeAction | ApiAction) -> ActionResult:
        res = client.submit(action).result(timeout=600)
        sink(res)
        return res

    attempt = problem.buggy if rng.random() < 0.5 else problem.solution
    for turn in range(max(1, turns - 1)):
        if apis and turn == 1:
            api = rng.choice(apis)
            req = (
                {"expr": f"{rng.randint(1, 99)}*{rng.randint(1, 99)}"}
                if api == "calc"
                else {"query": problem.name}
            )
            run(ApiAction(trajectory_id=tid, api=api, request=req))
            continue
        run(CodeAction(trajectory_id=tid, code=attempt + "\n" + problem.probe, timeout_s=30))
        if turn == 0:
            attempt = problem.solution if rng.random() < 0.8 else attempt  # the agent fixes its bug
    tests = [TestCase(name=n, assert_code=a) for n, a in problem.tests]
    run(CodeAction(trajectory_id=tid, code=attempt, test_cases=tests, cpus=f"1..{max_cpus}", timeout_s=60))
    client.close_trajectory(tid)


def run_demo(
    broker_url: str, cfg: TangramConfig, *, trajectories: int = 24, turns: int = 4, seed: int = 0
) -> Summary:
    """Run the workload and print progress and a summary. Returns the summary."""
    if not cfg.nodes.cpu:
        raise TangramError("the demo needs at least one CPU node in nodes.cpu")
    rng = random.Random(seed)
    apis = [a.name for a in cfg.apis if a.name in ("calc", "docsearch")]
    max_cpus = max(n.cores // n.numa_groups for n in cfg.nodes.cpu)
    expected = trajectories * turns
    summary = Summary()
    lock = threading.Lock()
    done = threading.Event()

    def sink(res: ActionResult) -> None:
        with lock:
            summary.results.append(res)

    def progress() -> None:
        while not done.wait(2.0):
            with lock:
                n = len(summary.results)
            print(f"  ... {n}/{expected} actions done", flush=True)

    print(
        f"demo: {trajectories} trajectories x {turns} turns on {len(cfg.nodes.cpu)} CPU node(s), "
        f"policy {cfg.scheduler.policy}"
    )
    ticker = threading.Thread(target=progress, daemon=True)
    ticker.start()
    t0 = time.monotonic()
    with (
        TangramClient(broker_url, config=cfg) as client,
        ThreadPoolExecutor(max_workers=trajectories) as pool,
    ):
        futs = [
            pool.submit(
                _trajectory, client, f"demo-{i}", PROBLEMS[i % len(PROBLEMS)], turns, max_cpus, apis,
                random.Random(rng.random()), sink,
            )
            for i in range(trajectories)
        ]  # fmt: skip
        for f in futs:
            try:
                f.result()
            except TangramError as e:
                print(f"  trajectory failed: {e}")
                summary.lost += 1
    done.set()
    summary.wall_s = time.monotonic() - t0
    print(summary.report())
    return summary
