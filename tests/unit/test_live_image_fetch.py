"""The live scheduler carries out its round's image fetches: it sends each to the CPU node's
queue and counts the image on its way there, so that later rounds send none again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tangram_celery.common.actions import CodeAction
from tangram_celery.testing import sent_messages
from tests.unit.test_service_loop import Harness, config

IMAGE = "tangram-swe/task:bug"


@pytest.fixture
def one_node(tmp_path: Any) -> Iterator[Harness]:
    cfg = config(
        str(tmp_path),
        nodes={"cpu": [{"name": "n0", "cores": 2, "memory_mb": 4096}]},
        apis=[],
        reward_models=[],
        scheduler={"policy": "tangram-fast", "check_invariants": True},
    )
    h = Harness(str(tmp_path), cfg=cfg)
    sent_messages(h.app, "tangram.cpu.n0")  # one memory:// broker per process: earlier tests' go
    h.svc.start()
    yield h
    sent_messages(h.app, "tangram.cpu.n0")


def test_a_new_trajectory_in_an_image_the_node_lacks_sends_one_fetch(one_node: Harness) -> None:
    """Given a node that reports it can fetch the image but does not hold it, when a new
    trajectory's first action in that image is placed there, then the node's queue gets a
    fetch order for the image beside the action, the scheduler counts it on its way, and the
    next action of another new trajectory in the image sends no second order."""
    h = one_node
    h.store.report_images("n0", {"held": [], "fetchable": [IMAGE], "layers": []})
    h.svc._liveness()  # the liveness pass reads the report (every few seconds in the loop)
    h.client.submit(CodeAction(id="a1", trajectory_id="t1", language="bash", code="true", image=IMAGE))
    h.svc.step(block_ms=None)
    sent = sent_messages(h.app, "tangram.cpu.n0")
    assert ("tangram.fetch_image", [IMAGE]) in [(task, list(args)) for task, args in sent], sent
    assert any(task == "tangram.run_cpu" for task, _ in sent), sent
    store = h.svc.state.cpu["n0"].store
    assert store is not None and IMAGE in store.fetching
    h.client.submit(CodeAction(id="a2", trajectory_id="t2", language="bash", code="true", image=IMAGE))
    h.svc.step(block_ms=None)
    again = [task for task, _ in sent_messages(h.app, "tangram.cpu.n0")]
    assert "tangram.fetch_image" not in again, again
