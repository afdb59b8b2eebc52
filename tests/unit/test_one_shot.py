"""One-shot actions: no trajectory (or `ephemeral`) in the models, the metadata and the queue."""

from __future__ import annotations

from scheduler.service.cluster import to_queued
from tangram_celery.common.actions import ActionStatus, ApiAction, CodeAction
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.wire import ActionMeta, ActionResult


def test_an_action_without_a_trajectory_is_one_shot_with_a_key_of_its_own() -> None:
    """Given code and API actions without a trajectory id, when reduced to metadata and queued,
    then they are ephemeral, tell the caller no trajectory, and get the scheduler key '~<id>'."""
    cfg = TangramConfig.model_validate({"nodes": {"cpu": [{"name": "n", "cores": 2, "memory_mb": 1024}]}})
    for action in (CodeAction(id="c1", code="print(1)"), ApiAction(id="a1", api="calc")):
        assert action.one_shot and action.trajectory_id is None
        meta = ActionMeta.of(action, 1.0)
        assert (meta.trajectory_id, meta.one_shot) == ("", True)
        if isinstance(action, CodeAction):
            assert to_queued(meta, cfg).trajectory_id == "~c1"


def test_an_ephemeral_action_of_a_trajectory_keeps_its_trajectory_for_the_caller() -> None:
    """Given an ephemeral code action of trajectory t, when queued, then the caller's metadata
    names t while the scheduler keys its sandbox apart from t's."""
    cfg = TangramConfig.model_validate({"nodes": {"cpu": [{"name": "n", "cores": 2, "memory_mb": 1024}]}})
    action = CodeAction(id="e1", trajectory_id="t", ephemeral=True, code="print(1)")
    meta = ActionMeta.of(action, 1.0)
    assert (meta.trajectory_id, meta.one_shot) == ("t", True)
    assert to_queued(meta, cfg).trajectory_id == "~e1"
    plain = ActionMeta.of(CodeAction(id="p1", trajectory_id="t", code="print(1)"), 1.0)
    assert not plain.one_shot and to_queued(plain, cfg).trajectory_id == "t"


def test_results_say_whether_the_sandbox_was_reset() -> None:
    """Given a result without the field (an older worker), when parsed, then sandbox_reset is False."""
    res = ActionResult.model_validate_json('{"action_id": "x", "status": "ok"}')
    assert res.sandbox_reset is False and res.status is ActionStatus.OK
