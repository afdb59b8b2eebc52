"""Nodes joining and leaving in the simulator (issue 39): nothing lost, nothing run twice,
policies see a new node, and traces keep the events."""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import replace

import pytest

from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.sim import ClusterSpec, Simulator, build, make_policy
from scheduler.sim.node_events import NodeChange, NodeEvent
from scheduler.sim.scenarios import Scenario
from scheduler.sim.trace import read_workload, write_workload

SMALL = {"batch": 60, "cpu_nodes": 3, "spot_nodes": 1, "drain_nodes": 1, "join_nodes": 1}
TIMES = {"lost_at_s": 15.0, "drain_at_s": 20.0, "join_at_s": 25.0, "down_s": 40.0}
CLUSTER = ClusterSpec(cpu_nodes=3, cores_per_node=8)  # busy: 60 trajectories on 24 cores


def spot() -> Scenario:
    return build("spot", {**SMALL, **TIMES}, cluster=CLUSTER)


class Recording(Simulator):
    """A simulator that remembers the node of every start."""

    starts: dict[str, list[tuple[float, str]]]

    def _start(self, now: float, qa: QueuedAction, alloc: Allocation, load: object = None) -> None:
        self.starts.setdefault(alloc.pool, []).append((now, qa.action_id))
        super()._start(now, qa, alloc, load)  # type: ignore[arg-type]


def run(sc: Scenario, policy: str) -> Recording:
    sim = Recording(sc, make_policy(policy, sc))
    sim.starts = {}
    sim.run()
    return sim


def steps_done(sim: Simulator) -> Counter[tuple[str, str]]:
    """How many records each (trajectory, step) has: a retried action keeps its step's id."""
    return Counter((r.trajectory_id, r.action_id.split("~")[0]) for r in sim.result.records)


@pytest.mark.parametrize("policy", ["tangram-fast", "fcfs-min", "static-pod"])
def test_spot_nodes_lose_nothing_and_run_nothing_twice(policy: str) -> None:
    """Given nodes lost, drained and joining mid-run, when simulated, then every step of every
    trajectory completes exactly once and the lost node's running actions were retried."""
    sc = spot()
    sim = run(sc, policy)
    done = steps_done(sim)
    assert len(done) == sc.num_actions and set(done.values()) == {1}
    assert sim.result.unfinished == 0
    assert sim.result.node_leaves == 2 and sim.result.node_joins == 3
    assert sim.result.node_retries > 0
    assert sim.result.summary()["node_retries"] == sim.result.node_retries


def test_nothing_starts_on_a_node_while_it_is_away() -> None:
    """Given a node lost at 15 s and one drained at 20 s, both back 40 s later, then no action
    starts on either while it is away, and both take new trajectories (arriving at 70 s) once
    back (the others stay on their sandboxes' nodes)."""
    sc = spot()
    sc.trajectories = [replace(t, start_s=70.0) if i % 2 else t for i, t in enumerate(sc.trajectories)]
    sim = run(sc, "tangram-fast")
    starts = sim.starts
    for node, left_s in (("cpu2", 15.0), ("cpu1", 20.0)):
        assert not [t for t, _ in starts[node] if left_s <= t < left_s + 40.0]
        assert [t for t, _ in starts[node] if t >= left_s + 40.0]


def test_policies_see_a_node_that_joins() -> None:
    """Given a busy cluster and a new node joining at 25 s, then actions start on it, none
    before it joined."""
    sc = spot()
    sim = run(sc, "tangram-fast")
    starts = sim.starts["cpu3"]
    assert starts and min(t for t, _ in starts) >= 25.0
    assert "cpu3" in sim.state.cpu


def test_a_drained_nodes_running_actions_finish_there() -> None:
    """Given a node drained at 20 s, then nothing is retried because of it (a drain is not a
    loss): with only a drain, no action is submitted twice."""
    sc = build("coding", {"batch": 60}, cluster=CLUSTER)
    sc.node_events = [NodeEvent(20.0, NodeChange.DRAIN, "cpu0"), NodeEvent(60.0, NodeChange.JOIN, "cpu0")]
    sim = run(sc, "tangram-fast")
    assert sim.result.node_retries == 0 and sim.result.unfinished == 0
    assert len(sim.result.records) == sc.num_actions


def test_a_gpu_node_lost_and_back() -> None:
    """Given a MOPD run whose GPU node 0 is lost at 20 s and back at 60 s, then every call
    completes once and the calls running there were retried."""
    sc = build("mopd", {"batch": 100})
    sc.node_events = [
        NodeEvent(20.0, NodeChange.LOSE, "gpu0", ResourceKind.GPU),
        NodeEvent(60.0, NodeChange.JOIN, "gpu0", ResourceKind.GPU),
        NodeEvent(30.0, NodeChange.JOIN, "gpu9", ResourceKind.GPU, gpus=8),
    ]
    sim = run(sc, "tangram-fast")
    done = steps_done(sim)
    assert len(done) == sc.num_actions and set(done.values()) == {1}
    assert "gpu9" in sim.state.gpu and sim.result.node_joins == 2


def test_node_events_survive_a_trace_roundtrip() -> None:
    """Given a scenario with node events, when written as a trace and read back, then the
    events are the same and the replay goes through them."""
    sc = spot()
    buf = io.StringIO()
    write_workload(sc, buf)
    back = read_workload(io.StringIO(buf.getvalue()))
    assert back.node_events == sc.node_events
    replay = run(back, "tangram-fast").result  # (times are rounded to the µs in a trace)
    assert len(replay.records) == sc.num_actions and replay.node_retries > 0


def test_a_bad_node_event_kind_is_rejected() -> None:
    """An API pool cannot join or leave as a node."""
    with pytest.raises(ValueError, match="cpu or gpu"):
        NodeEvent.from_dict({"at_s": 1.0, "change": "join", "node": "x", "kind": "api"})
