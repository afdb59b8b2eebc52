"""Priorities and fair share across jobs."""

from scheduler.fairshare import order_queue
from scheduler.model import CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import get_policy
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState, CpuNode
from scheduler.round import FairShareSpec, Round


def act(i: int, job: str, t: float, prio: int = 0, units: int = 1) -> QueuedAction:
    return QueuedAction(
        f"{job}{i}",
        f"{job}-traj{i}",
        CostVector(ResourceKind.CPU, Elastic.fixed(units)),
        t,
        job_id=job,
        priority=prio,
    )


def ids(q: list[QueuedAction]) -> list[str]:
    return [a.action_id for a in q]


def test_single_job_is_fcfs() -> None:
    """One job: the order is untouched (the paper's FCFS)."""
    q = [act(i, "a", float(i), prio=i % 3) for i in range(5)]
    assert ids(order_queue(q, {}, {}, now_s=10.0)) == ids(q)


def test_flooding_job_does_not_starve_a_late_one() -> None:
    """Given job a submitted 6 actions before job b's 3, the order alternates a and b."""
    q = [act(i, "a", 0.0 + i * 0.01) for i in range(6)] + [act(i, "b", 1.0 + i * 0.01) for i in range(3)]
    assert ids(order_queue(q, {}, {}, now_s=1.1)) == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "a4", "a5"]


def test_units_held_and_weights_count() -> None:
    """A job already holding units waits; a weight of 2 takes twice the share."""
    q = [act(0, "a", 0.0), act(1, "a", 0.1), act(0, "b", 0.2), act(1, "b", 0.3)]
    assert ids(order_queue(q, {"a": 2}, {}, now_s=0.5))[:2] == ["b0", "b1"]
    q = [act(i, "a", i * 0.01) for i in range(4)] + [act(i, "b", 0.5 + i * 0.01) for i in range(4)]
    order = ids(order_queue(q, {}, {"a": 2.0}, now_s=0.6))
    assert order[:3] == ["a0", "b0", "a1"] and order[3] == "a2"


def test_priority_first_and_aging_prevents_starvation() -> None:
    """A high-priority job goes first; a low one that waited long enough catches up."""
    q = [act(0, "low", 0.0, prio=0), act(0, "high", 5.0, prio=1)]
    assert ids(order_queue(q, {}, {}, now_s=6.0, aging_s=60.0)) == ["high0", "low0"]
    # After 120 s of waiting, the low job's level is 2 > 1.
    assert ids(order_queue(q, {}, {}, now_s=120.0, aging_s=60.0)) == ["low0", "high0"]


def test_round_gives_the_late_job_cores() -> None:
    """Given 2 free cores and job a's 4 actions ahead of job b's, one core goes to each job."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 2, 10_000)})
    q = WaitingQueue([act(i, "a", i * 0.01) for i in range(4)] + [act(0, "b", 1.0)])
    plan = Round(get_policy("fcfs-min"), fair=FairShareSpec()).plan(q, state, now_s=1.0)
    assert sorted(a.action_id for a in plan.allocs) == ["a0", "b0"]


class _Seen:
    """A policy that records the queue object it was handed."""

    name = "seen"

    def __init__(self) -> None:
        self.inner = get_policy("fcfs-min")
        self.execution = self.inner.execution
        self.queues: list[object] = []

    def decide(self, queue, state, now_s):  # type: ignore[no-untyped-def]
        self.queues.append(queue)
        return self.inner.decide(queue, state, now_s)


def test_one_job_hands_the_indexed_queue_through() -> None:
    """Given actions of one job, the policy gets the WaitingQueue itself (its index intact);
    once a second job waits, a fair-ordered list; a held job's share counts from its starts."""
    state = ClusterState(cpu={"n": CpuNode("n", ((0, 1),), 10_000, free={0})})  # core 1 busy elsewhere
    q = WaitingQueue([act(i, "a", i * 0.01) for i in range(3)])
    seen = _Seen()
    rnd = Round(seen, fair=FairShareSpec())
    plan = rnd.plan(q, state, now_s=1.0)
    assert seen.queues[-1] is q and [a.action_id for a in plan.allocs] == ["a0"]
    state.apply(plan.allocs[0], q.pop("a0"), 1.0)
    q.append(act(0, "b", 2.0))
    state.cpu["n"].free.add(1)  # core 1 comes back while a0 runs
    rnd.plan(q, state, now_s=2.0)
    assert isinstance(seen.queues[-1], list)
    assert [a.action_id for a in seen.queues[-1]][:1] == ["b0"]  # job a holds a core: b first
