"""One trace through the simulator and through the live service's loop: the same allocations.

The simulator and the live loop run the same round (`scheduler.round.Round`). This drives one
closed-loop trace (trajectories of code, elastic test and API actions, memory short enough that
idle trajectories are evicted) through both: the `Simulator`, and a `SchedulerService` on the
in-memory twin of the store whose workers the test plays, completing each action when the
trace says it ends. Every round of both must allocate the same actions to the same cores.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Sequence
from typing import Any

import pytest

from scheduler.duration import Amdahl
from scheduler.estimator import DurationEstimator, Prior
from scheduler.execution import TimeShareSpec
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies import get_policy
from scheduler.resources import ClusterState
from scheduler.service import SchedulerService
from scheduler.sim.cluster import ApiSpec, ClusterSpec, ExecParams
from scheduler.sim.engine import Simulator
from scheduler.sim.scenarios import Scenario
from scheduler.sim.workload import SimAction, SimTrajectory, Step
from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.config import parse_config
from tangram_celery.common.wire import ActionMeta, ActionResult, Completion, EventStatus, TaskOrder
from tangram_celery.testing import memory_app, memory_store, sent_messages

NODES, CORES, NUMA, MEMORY_MB = 2, 4, 2, 2048
PRIORS = {"code": Prior(2.0), "tests": Prior(6.0, 0.9), "api:calc": Prior(0.5)}
Round = tuple[float, list[tuple[str, str, int, tuple[int, ...], tuple[str, ...]]]]


def trace(seed: int = 7, n: int = 14) -> list[SimTrajectory]:
    """Trajectories of 2-5 steps: rigid code (1 core), elastic tests (1..2 cores, within a NUMA
    group) and API calls; 512 MiB each, so at most 8 sandboxes fit and idle ones get evicted."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        steps = []
        for _ in range(rng.randint(2, 5)):
            r = rng.random()
            if r < 0.5:
                a = SimAction("code", ResourceKind.CPU, (1,), rng.uniform(0.5, 4.0), memory_mb=512)
            elif r < 0.8:
                a = SimAction(
                    "tests", ResourceKind.CPU, (1, 2), rng.uniform(2.0, 9.0), Amdahl(0.9), memory_mb=512
                )
            else:
                a = SimAction(
                    "api:calc", ResourceKind.API, (1,), rng.uniform(0.2, 1.0), target="calc", api_quota=1
                )
            steps.append(Step(round(rng.uniform(0.1, 3.0), 3), a))
        out.append(SimTrajectory(f"t{i}", round(rng.uniform(0.0, 2.0), 3), tuple(steps)))
    return out


class Recorder:
    """A policy wrapper that records every round's allocations (the rounds both executors run)."""

    def __init__(self, name: str, **params: Any) -> None:
        self.inner = get_policy(name, **params)
        self.name = self.inner.name
        self.execution = self.inner.execution
        self.rounds: list[Round] = []

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        out = self.inner.decide(queue, state, now_s)
        rows = [(live_id(a.action_id), a.pool, a.units, a.unit_ids, a.evict) for a in out]
        self.rounds.append((round(now_s, 9), rows))
        return out


def live_id(sim_id: str) -> str:
    return sim_id.replace("/", ".")  # the simulator's ids have a '/', which action ids may not


def simulate(
    policy: str, trajs: list[SimTrajectory], estimator: DurationEstimator | None = None, **params: Any
) -> tuple[list[Round], dict[str, float]]:
    """The simulator's rounds, and how long each action ran (its start to its end)."""
    scenario = Scenario(
        "parity",
        trajs,
        ClusterSpec(
            cpu_nodes=NODES,
            cores_per_node=CORES,
            numa_groups=NUMA,
            memory_mb_per_node=MEMORY_MB,
            apis={"calc": ApiSpec(max_concurrency=1)},
        ),
        dict(PRIORS),
        exec_params=ExecParams(exec_overhead_s=0.0, sandbox_start_s=0.0),
    )
    rec = Recorder(policy, **params)
    res = Simulator(scenario, rec, learn=False, estimator=estimator).run()
    return rec.rounds, {live_id(r.action_id): r.ended_s - r.started_s for r in res.records}


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def run_live(
    policy: str,
    trajs: list[SimTrajectory],
    tmp: str,
    ran_s: dict[str, float] | None = None,
    estimator: DurationEstimator | None = None,
    time_share: dict[str, Any] | None = None,
    **params: Any,
) -> list[Round]:
    """The trace through a live scheduler: the test submits each step when the trace says, plays
    the workers (an action ends its true duration after it was sent, or as long as it ran in the
    simulator, `ran_s`) and closes trajectories."""
    cfg = parse_config(
        {
            "state_dir": tmp,
            "nodes": {
                "cpu": [
                    {"name": f"cpu{i}", "cores": CORES, "numa_groups": NUMA, "memory_mb": MEMORY_MB}
                    for i in range(NODES)
                ]
            },
            "apis": [{"name": "calc", "handler": "m:f", "max_concurrency": 1}],
            "scheduler": {
                "policy": policy,
                "priors": {k: {"t1_s": p.t1_s, "parallel_fraction": p.p} for k, p in PRIORS.items()},
                "check_invariants": True,  # the live round's core loans conserve work
                **({"time_share": time_share} if time_share is not None else {}),
            },
        }
    )
    store, app, clock = memory_store(), memory_app(), Clock()
    rec = Recorder(policy, **params)
    # the estimator learns nothing here: the test's worker reports no exec time
    svc = SchedulerService(
        cfg, "memory://", policy=rec, store=store, app=app, clock=clock, record=False, estimator=estimator
    )
    svc.start()
    events: list[tuple[float, int, int, Any]] = []
    seq = 0

    def push(t_s: float, kind: int, data: Any) -> None:  # as the simulator orders its events
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t_s, kind, seq, data))

    finish, submit = 0, 2
    for i, t in enumerate(trajs):
        push(t.start_s + t.steps[0].think_s, submit, (i, 0))
    step_of: dict[str, tuple[int, int]] = {}
    queues = [f"tangram.cpu.cpu{i}" for i in range(NODES)] + ["tangram.api.calc"]
    while events:
        now = events[0][0]
        clock.now_s = now
        while events and events[0][0] == now:
            _, kind, _, data = heapq.heappop(events)
            if kind == submit:
                i, j = data
                aid = f"{trajs[i].trajectory_id}.{j}"
                a = trajs[i].steps[j].action
                step_of[aid] = (i, j)
                if a.key is ResourceKind.API:
                    meta = ActionMeta(
                        id=aid, type="api", api="calc", trajectory_id=trajs[i].trajectory_id, submitted_s=now
                    )
                else:
                    units = (a.units[0], a.units[-1])
                    meta = ActionMeta(
                        id=aid,
                        type="code",
                        cpus=units,
                        memory_mb=a.memory_mb,
                        has_tests=a.kind == "tests",
                        trajectory_id=trajs[i].trajectory_id,
                        submitted_s=now,
                    )
                store.submit([(aid, meta.dumps(), "{}")], 0)
                continue
            aid, attempt = data
            i, j = step_of[aid]
            assert not isinstance(store.claim(aid, attempt, "w", time.time()), str)
            result = ActionResult(action_id=aid, status=ActionStatus.OK).model_dump_json()
            store.complete(aid, result, Completion(status=EventStatus.OK, worker="w", act_s=0.0))
            if j + 1 < len(trajs[i].steps):
                push(now + trajs[i].steps[j + 1].think_s, submit, (i, j + 1))
            else:
                store.control({"control": "close", "trajectory_id": trajs[i].trajectory_id})
        svc.step(block_ms=None)
        for q in queues:
            for task, args in sent_messages(app, q):
                if not task.startswith("tangram.run_"):  # closes, core loans
                    continue
                order = TaskOrder.model_validate(args[1])
                i, j = step_of[order.action_id]
                took_s = (
                    ran_s[order.action_id]
                    if ran_s is not None
                    else trajs[i].steps[j].action.true_duration_s(order.units)
                )
                push(now + took_s, finish, (order.action_id, order.attempt))
    assert not svc.state.running and not svc.waiting
    return rec.rounds


@pytest.mark.parametrize("policy", ["tangram-fast", "tangram-dp", "fcfs-min"])
def test_simulator_and_live_loop_allocate_the_same(policy: str, tmp_path: Any) -> None:
    """Given one trace, the simulator and the live loop (in-memory store, the test as workers)
    run the same rounds at the same times and every round allocates the same actions to the
    same cores, evicting the same idle trajectories."""
    trajs = trace()
    sim, _ = simulate(policy, trajs)
    live = run_live(policy, trajs, str(tmp_path))
    assert any(row[4] for _, rows in sim for row in rows), "the trace should make the policy evict"
    assert len(live) == len(sim)
    for a, b in zip(sim, live, strict=True):
        assert a == b


def test_simulator_and_live_loop_time_share_the_same(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given one trace and `code` measured short on both sides, with the bounds the 2-core local
    config ships (1-core hosts, two sharers per core), the simulator and the live loop place
    the same time sharers in the same rounds, on the same held cores, and every policy round
    allocates the same (the test's workers run each action as long as it ran in the simulator,
    where sharing slowed it)."""
    import scheduler.round.plan as round_module

    share = {"weight": 1.0, "min_share": 0.4, "max_holder_loss": 0.75, "per_core": 2}
    placed: list[tuple[float, list[tuple[str, str, tuple[int, ...], tuple[str, ...]]]]] = []
    inner = round_module.time_sharers

    def recording(*args: Any, **kw: Any) -> list[Allocation]:
        out = inner(*args, **kw)
        if out:
            placed.append(
                (round(args[6], 9), [(live_id(a.action_id), a.pool, a.unit_ids, a.evict) for a in out])
            )
        return out

    monkeypatch.setattr(round_module, "time_sharers", recording)

    def measured() -> DurationEstimator:
        est = DurationEstimator(priors=dict(PRIORS))
        for _ in range(5):
            est.observe("code", 1, 1.0)
        return est

    spec = TimeShareSpec(**share)
    trajs = trace()
    sim, ran_s = simulate("tangram-fast", trajs, measured(), share=spec)
    sim_placed = list(placed)
    placed.clear()
    live = run_live("tangram-fast", trajs, str(tmp_path), ran_s, measured(), share, share=spec)
    assert len(sim_placed) >= 3, "the trace should make actions time-share"
    assert placed == sim_placed
    assert len(live) == len(sim)
    for a, b in zip(sim, live, strict=True):
        assert a == b
