"""Short CPU actions riding in batches (scheduler.policies.cpu_batch) on real processes.

Each test runs a whole deployment (embedded Redis, scheduler, a CPU worker on the namespace
backend). Riders form only once the scheduler has measured the kind short, so each test first
runs a few actions of that kind.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tangram_celery import ActionStatus, CodeAction
from tests.fixtures.common import unavailable

NAMESPACE = {"backend": "namespace", "default_timeout_s": 10, "prewarm": 2}
NODE = {"cpu": [{"name": "n0", "cores": 2, "memory_mb": 4096}]}


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    from tangram_celery.sandbox.namespace import bwrap_path

    if os.geteuid() != 0 or bwrap_path() is None:
        unavailable("the namespace sandbox needs root and bubblewrap")


def _measure(client: Any, n: int = 8) -> None:
    """Let the scheduler measure trivial code actions (riders need a measured kind)."""
    hs = client.submit_many([CodeAction(trajectory_id=f"m{i}", code="pass", memory_mb=128) for i in range(n)])
    assert all(h.result(timeout=120).ok for h in hs)


def _completions(deployment: Any, ids: set[str], timeout_s: float = 30.0) -> Counter[str]:
    """How often each of `ids` is in the scheduler's run log (flushed every second)."""
    path = Path(deployment.state_dir) / "actions.jsonl"
    deadline = time.monotonic() + timeout_s
    while True:
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        done = Counter(r["action_id"] for r in rows if r.get("action_id") in ids)
        if set(done) == ids or time.monotonic() > deadline:
            return done
        time.sleep(0.5)


@pytest.mark.deploy(nodes=NODE, sandbox=NAMESPACE)
def test_a_burst_of_short_actions_rides_in_batches_each_run_once(client, deployment) -> None:
    """Given a measured short kind, when 60 new trajectories' actions arrive at once on 2
    cores, then they are dispatched in batches (results report batches of more than one),
    every action completes once with its own output, and no stall is logged."""
    _measure(client)
    n = 60
    hs = client.submit_many(
        [
            CodeAction(trajectory_id=f"b{i}", code=f"print({i} * 3)", memory_mb=128, timeout_s=30)
            for i in range(n)
        ]
    )
    results = [h.result(timeout=300) for h in hs]
    assert [(r.status, r.stdout.strip()) for r in results] == [
        (ActionStatus.OK, str(i * 3)) for i in range(n)
    ]
    sizes = Counter(r.batch_size for r in results)
    assert max(sizes) > 1, f"no batch formed: {sizes}"
    assert all(r.attempts == 1 for r in results)
    log = (Path(deployment.state_dir) / "logs" / "scheduler.log").read_text(errors="replace")
    assert "no progress" not in log
    print(f"batch sizes: {dict(sorted(sizes.items()))}")


@pytest.mark.deploy(nodes=NODE, sandbox=NAMESPACE)
def test_a_trajectorys_actions_submitted_together_share_its_sandbox(client) -> None:
    """Given a measured short kind, when one trajectory submits 16 actions at once, each
    appending its number to a file, then all run once, one at a time, in the trajectory's one
    sandbox: the action that ran last sees all 16 numbers, each once, and no result reports a
    reset. (Their order is the scheduler's: a caller that needs order waits for each result.)"""
    _measure(client)
    code = "open('seq', 'a').write('{i} '); print(open('seq').read())"
    hs = client.submit_many(
        [CodeAction(trajectory_id="together", code=code.format(i=i), memory_mb=128) for i in range(16)]
    )
    results = [h.result(timeout=300) for h in hs]
    assert all(r.ok and not r.sandbox_reset for r in results), [r for r in results if not r.ok][:1]
    seen = sorted((r.stdout.split() for r in results), key=len)
    assert [len(s) for s in seen] == list(range(1, 17))
    assert sorted(seen[-1], key=int) == [str(i) for i in range(16)]


@pytest.mark.deploy(nodes=NODE, sandbox=NAMESPACE)
def test_a_cpu_worker_killed_mid_batch_loses_nothing(client, deployment) -> None:
    """Given batches of short actions running, when the CPU worker is SIGKILLed and restarted,
    then every action completes exactly once from the client's view with its own output (the
    interrupted batch's actions with a later attempt), and the run log holds each once."""
    _measure(client)
    n = 120
    code = "import time; time.sleep(0.02); print({i})"
    hs = client.submit_many(
        [
            CodeAction(trajectory_id=f"k{i}", code=code.format(i=i), memory_mb=128, timeout_s=30)
            for i in range(n)
        ]
    )
    hs[10].result(timeout=120)  # batches are running now
    deployment.kill("worker-cpu-n0")
    results = [h.result(timeout=300) for h in hs]
    assert [(r.status, r.stdout.strip()) for r in results] == [(ActionStatus.OK, str(i)) for i in range(n)]
    retried = [r for r in results if r.attempts > 1]
    assert retried, "the killed worker's claimed actions should have been retried"
    done = _completions(deployment, {h.id for h in hs})
    assert len(done) == n and set(done.values()) == {1}, [a for a, c in done.items() if c != 1]
    print(f"retried after the kill: {len(retried)} of {n}")


# Generous bounds: the test is about the hand-back, not about whether a loaded machine measures
# `pass` under the default 50 ms (a noisy mean would leave every action alone and nothing to hand back).
HAND_BACK = {"cpu_batch": {"hand_back_after_ms": 500, "max_action_ms": 5000, "max_batch_ms": 60000}}


@pytest.mark.deploy(nodes=NODE, sandbox=NAMESPACE, scheduler=HAND_BACK)
def test_riders_behind_a_hung_action_are_handed_back(client) -> None:
    """Given a measured short kind and both cores busy, when a hung action (until its 30 s
    limit) and 30 short ones queue behind them, then the hung action leads a batch with riders
    behind it, after hand_back_after_ms the riders go back to the scheduler, and all of them
    complete (on the other core, each once, none given up) while the hung action still runs."""
    _measure(client)
    # Both cores busy first, so that all of what follows waits in one queue: the round that
    # starts the hung action (first in line) gives it riders, however the intake is read.
    busy = client.submit_many(
        [
            CodeAction(trajectory_id=f"busy{i}", code="import time; time.sleep(1.5)", memory_mb=128)
            for i in range(2)
        ]
    )
    time.sleep(0.5)
    hung, *short = client.submit_many(
        [CodeAction(trajectory_id="hung", code="while True: pass", memory_mb=128, timeout_s=30)]
        + [
            CodeAction(trajectory_id=f"s{i}", code=f"print({i})", memory_mb=128, timeout_s=30)
            for i in range(30)
        ]
    )
    results = [h.result(timeout=25) for h in short]
    assert all(h.result(timeout=1).ok for h in busy)
    assert not hung.done(), "the short actions should not have waited for the hung one"
    assert [(r.status, r.stdout.strip()) for r in results] == [(ActionStatus.OK, str(i)) for i in range(30)]
    assert any(r.attempts > 1 for r in results), "the hung action's riders should have been handed back"
    assert hung.result(timeout=60).status is ActionStatus.TIMEOUT


@pytest.mark.deploy(nodes=NODE, sandbox=NAMESPACE)
def test_batches_queued_behind_running_ones_take_turns_on_their_cores(client, deployment) -> None:
    """Given a measured short kind, when 96 new trajectories' actions arrive at once on 2 cores,
    then riders are queued behind batches still running (the scheduler counts them), every
    action completes once with its own output, and no two actions ran at once on a core: each
    reports the cores it may run on and when it started and ended, and on each core those
    intervals do not overlap (a batch sent behind another waits for it in the worker)."""
    _measure(client)
    joined = deployment.counter("scheduler", "tangram_cpu_batch_joins_total")
    n = 96
    code = (
        "import os, time; t0 = time.time(); time.sleep(0.004); "
        "print({i}, *sorted(os.sched_getaffinity(0)), t0, time.time(), sep=',')"
    )
    hs = client.submit_many(
        [
            CodeAction(trajectory_id=f"j{i}", code=code.format(i=i), memory_mb=128, timeout_s=30)
            for i in range(n)
        ]
    )
    results = [h.result(timeout=300) for h in hs]
    assert all(r.status is ActionStatus.OK for r in results), [r for r in results if not r.ok][:1]
    rows = [r.stdout.strip().split(",") for r in results]
    assert [int(row[0]) for row in rows] == list(range(n))
    by_cores: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        by_cores.setdefault(" ".join(row[1:-2]), []).append((float(row[-2]), float(row[-1])))
    assert all(len(k.split()) == 1 for k in by_cores), (
        f"an action ran on more than one core: {list(by_cores)}"
    )
    for cores, spans in by_cores.items():
        spans.sort()
        overlaps = [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1]]
        assert not overlaps, f"core {cores}: actions ran at once: {overlaps[:3]}"
    assert deployment.counter("scheduler", "tangram_cpu_batch_joins_total") > joined
    assert all(r.attempts == 1 for r in results)
