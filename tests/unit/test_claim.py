"""A worker's claim (tangram_celery.store.worker_side): granted with the typed metadata and
payload, or refused with the reason."""

from __future__ import annotations

import time

from tangram_celery.common.actions import ApiAction
from tangram_celery.common.wire import ActionMeta
from tangram_celery.store.worker_side import Claim, Refused
from tangram_celery.testing import dispatch, memory_store


def test_a_claim_is_granted_once_with_its_typed_metadata_and_refused_with_a_reason() -> None:
    """Given a dispatched action, when its attempt claims it, then the claim carries its
    metadata (typed) and its payload; another worker, an older attempt and an unknown action
    are refused with a reason a worker can compare as a string."""
    store = memory_store()
    action = ApiAction(id="a1", trajectory_id="t", api="calc", request={"x": 1})
    meta = ActionMeta.of(action, time.time())
    store.submit([(action.id, meta.dumps(), action.model_dump_json())], max_queued=0)
    dispatch(store, "a1", 2)

    assert store.claim("a1", 1, "w1", time.time()) is Refused.STALE
    claim = store.claim("a1", 2, "w1", time.time())
    assert isinstance(claim, Claim)
    assert claim.meta == meta and claim.payload["request"] == {"x": 1}
    assert store.claim("a1", 2, "w2", time.time()) == "running"
    assert store.claim_many([("a1", 2), ("nope", 1)], "w1", time.time())[1] is Refused.MISSING


def test_a_second_delivery_to_the_same_worker_does_not_run_the_action_again() -> None:
    """Given an action claimed by a worker, when the same attempt's message reaches that worker
    again (the scheduler re-sent it after a Redis restart, or kombu redelivered it unacknowledged)
    and another of its threads claims it, then that claim is refused as running, while a retry of
    the first claim call (its reply lost with Redis) still finds its own claim."""
    store = memory_store()
    action = ApiAction(id="a1", trajectory_id="t", api="calc", request={"x": 1})
    store.submit([(action.id, ActionMeta.of(action, 0.0).dumps(), action.model_dump_json())], max_queued=0)
    dispatch(store, "a1", 1)

    first = store.claim("a1", 1, "w1", time.time(), token="first-call")
    second_delivery = store.claim("a1", 1, "w1", time.time())
    retried_first = store.claim("a1", 1, "w1", time.time(), token="first-call")
    batch = store.claim_many([("a1", 1)], "w1", time.time())

    assert isinstance(first, Claim) and isinstance(retried_first, Claim)
    assert second_delivery is Refused.RUNNING and batch == [Refused.RUNNING]
