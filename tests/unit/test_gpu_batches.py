"""GPU chunks shared by a batch of reward actions (`ClusterState.share`)."""

from __future__ import annotations

import pytest

from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies.common import busy_by_pool
from scheduler.resources import ClusterState, GpuNode


def reward(aid: str) -> QueuedAction:
    cost = CostVector(ResourceKind.GPU, Elastic((1, 2)))
    return QueuedAction(aid, aid, cost, 0.0, t1_s=1.0, kind="reward:rm", target="rm")


def gpu_state() -> ClusterState:
    return ClusterState(gpu={"g": GpuNode("g", 2, 1024)})


def test_riders_share_the_chunk_and_it_is_freed_by_the_last_one_out() -> None:
    """Given a chunk allocated to one action and shared by two riders, when they finish in any
    order, then the chunk stays held until the last one is released, and counts once as busy."""
    state = gpu_state()
    state.apply(Allocation("lead", ResourceKind.GPU, "g", 1, (0,)), reward("lead"), 0.0)
    for rider in ("r1", "r2"):
        state.share(Allocation(rider, ResourceKind.GPU, "g", 1, (0,)), reward(rider), 0.0)
    assert busy_by_pool(state, 0.0)[("gpu", "g", 0)] == [(1.0, 1)]
    state.release("lead")
    state.release("r2")
    assert state.gpu["g"].free == {1}
    state.release("r1")
    assert state.gpu["g"].free == {0, 1}
    assert not state.gpu["g"].riders and not state.shared


def test_sharing_needs_a_held_chunk_and_hold_rebuilds_batches_after_a_restart() -> None:
    """Sharing a free chunk is refused; `hold` (used by recovery) applies the first allocation
    of a chunk and shares the next ones, so the rebuilt state frees it only once."""
    state = gpu_state()
    with pytest.raises(ValueError, match="not held"):
        state.share(Allocation("r", ResourceKind.GPU, "g", 1, (1,)), reward("r"), 0.0)
    for aid in ("a", "b"):
        state.hold(Allocation(aid, ResourceKind.GPU, "g", 1, (1,)), reward(aid), 0.0)
    assert state.shared == {"b"} and state.gpu["g"].free == {0}
    copy = state.copy()
    copy.release("a")
    copy.release("b")
    assert copy.gpu["g"].free == {0, 1} and state.gpu["g"].free == {0}
