"""The Redis store's exactly-once protocol against a real Redis."""

from __future__ import annotations

import json
import time

import pytest

from tangram_celery.store import Store, akey, nkey

pytestmark = pytest.mark.integration


def _submit(store: Store, action_id: str) -> None:
    meta = json.dumps({"id": action_id, "trajectory_id": "t", "submitted_s": time.time()})
    store.submit([(action_id, meta, '{"p": 1}')], max_queued=0)


def test_result_survives_a_wake_up_lost_with_its_reply(redis_url: str) -> None:
    """Given a completed action whose wake-up token was consumed by a pop whose reply was lost,
    the waiter still gets the result (from the action's hash) instead of blocking forever."""
    store = Store(redis_url)
    _submit(store, "a1")
    store.r.hset(akey("a1"), mapping={"state": "dispatched", "attempt": "1"})
    assert not isinstance(store.claim("a1", 1, "w", time.time()), str)
    store.complete("a1", '{"status": "ok"}', {"status": "ok"})
    store.r.lpop(nkey("a1"))  # what a BLPOP whose reply died with Redis leaves behind
    t0 = time.monotonic()
    assert store.wait_result("a1", timeout_s=10, poll_s=0.2) == '{"status": "ok"}'
    assert time.monotonic() - t0 < 5


def test_claims_are_exactly_once_and_attempt_scoped(redis_url: str) -> None:
    """A second claim, a stale attempt, and a second completion are all refused."""
    store = Store(redis_url)
    _submit(store, "a2")
    store.r.hset(akey("a2"), mapping={"state": "dispatched", "attempt": "2"})
    assert store.claim("a2", 1, "w1", time.time()) == "stale"
    assert not isinstance(store.claim("a2", 2, "w1", time.time()), str)
    assert store.claim("a2", 2, "w2", time.time()) == "running"
    assert not isinstance(store.claim("a2", 2, "w1", time.time()), str)  # own claim, reply lost
    assert store.complete("a2", "{}", {}) is True
    assert store.complete("a2", "{}", {}) is False


def test_resubmitting_the_same_action_is_idempotent(redis_url: str) -> None:
    """The same action submitted twice (a retry after a lost reply) is enqueued once."""
    store = Store(redis_url)
    _submit(store, "a3")
    store.submit([("a3", "{}", '{"p": 1}')], max_queued=0)
    assert store.r.xlen("tangram:intake") == 1
