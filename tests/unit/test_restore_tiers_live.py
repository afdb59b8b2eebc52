"""The live scheduler learns GPU nodes' host tiers and restore costs from the events stream
(issue 38), on the in-memory twin of the store; the test plays the GPU worker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from scheduler.gpu_cache import Tier
from tangram_celery.common.actions import RewardAction
from tangram_celery.common.wire import ChunkServices
from tests.unit.test_service_loop import Harness, config


@pytest.fixture
def h(tmp_path: Any) -> Iterator[Harness]:
    """A fcfs-min scheduler over one GPU node of 2 GPUs (rm and sim of 1500 MiB: one per GPU)."""
    harness = Harness(str(tmp_path), cfg=config(str(tmp_path)))
    harness.messages("tangram.gpu.g0")  # memory:// is one broker per process: earlier tests' go
    harness.svc.start()
    yield harness
    harness.messages("tangram.gpu.g0")


def test_a_report_with_a_host_map_gives_the_node_a_host_tier(h: Harness) -> None:
    """Given a residency report of rm on GPU 0 and sim kept in host memory on GPU 1, the state
    knows both and that the node has a host tier; a report without a host map changes neither."""
    h.store.publish_residency("g0", {(0,): ["rm"]}, host_resident={(1,): ["sim"]})
    h.svc.step(block_ms=None)
    g = h.svc.state.gpu["g0"]
    assert g.host_tier and g.host_resident == {(1,): ["sim"]} and g.tier((1,), "sim") is Tier.HOST
    h.store.publish_residency("g0", {(0,): ["rm"]})
    h.svc.step(block_ms=None)
    assert g.host_resident == {(1,): ["sim"]}


def test_completions_teach_restore_costs_and_the_predicted_eviction_keeps_a_host_copy(h: Harness) -> None:
    """Given rm on GPU 0 of a node with a host tier and GPU 1 busy, a sim call placed on GPU 0
    evicts rm in the scheduler's view, which then counts rm as kept in host memory there; the
    call's completion (a cold load of 4 s) teaches sim's cold cost, and its host map replaces
    the prediction."""
    h.store.publish_residency("g0", {(0,): ["rm"]}, host_resident={})
    h.svc.state.gpu["g0"].free.discard(1)
    h.svc.step(block_ms=None)
    h.client.submit(
        RewardAction(id="s1", trajectory_id="t", model="sim", inputs={"response": "x", "reference": "y"})
    )
    h.svc.step(block_ms=None)
    g = h.svc.state.gpu["g0"]
    assert g.resident == {(0,): ["sim"]} and g.host_resident == {(0,): ["rm"]}
    [(aid, order)] = h.messages("tangram.gpu.g0")
    h.run(
        aid,
        order,
        resident=[ChunkServices(gpus=(0,), services=["sim"])],
        host_resident=[],
        load_tier="cold",
        load_s=4.0,
    )
    h.svc.step(block_ms=None)
    assert h.svc.restore_costs.cost_s("sim", Tier.COLD) == 4.0
    assert h.svc.restore_costs.counts == {Tier.COLD: 1}
    assert g.restore_costs is h.svc.restore_costs and g.host_resident == {}
