"""The Redis store's exactly-once protocol against a real Redis."""

from __future__ import annotations

import time

import pytest

from tangram_celery.common.wire import ActionMeta, Completion, EventStatus
from tangram_celery.store import Store, akey, nkey
from tangram_celery.testing import dispatch

OK = Completion(status=EventStatus.OK)


def _meta(action_id: str) -> str:  # what a claim reads back, typed
    return ActionMeta(
        id=action_id, type="api", api="calc", trajectory_id="t", submitted_s=time.time()
    ).dumps()


def _submit(store: Store, action_id: str) -> None:
    store.submit([(action_id, _meta(action_id), '{"p": 1}')], max_queued=0)


def test_result_survives_a_wake_up_lost_with_its_reply(redis_url: str) -> None:
    """Given a completed action whose wake-up token was consumed by a pop whose reply was lost,
    the waiter still gets the result (from the action's hash) instead of blocking forever."""
    store = Store(redis_url)
    _submit(store, "a1")
    dispatch(store, "a1", 1)
    assert not isinstance(store.claim("a1", 1, "w", time.time()), str)
    store.complete("a1", '{"status": "ok"}', OK)
    store.r.lpop(nkey("a1"))  # what a BLPOP whose reply died with Redis leaves behind
    t0 = time.monotonic()
    assert store.wait_result("a1", timeout_s=10, poll_s=0.2) == '{"status": "ok"}'
    assert time.monotonic() - t0 < 5


def test_claims_are_exactly_once_and_attempt_scoped(redis_url: str) -> None:
    """A second claim, a stale attempt, and a second completion are all refused."""
    store = Store(redis_url)
    _submit(store, "a2")
    dispatch(store, "a2", 2)
    assert store.claim("a2", 1, "w1", time.time()) == "stale"
    assert not isinstance(store.claim("a2", 2, "w1", time.time(), token="call-1"), str)
    assert store.claim("a2", 2, "w2", time.time()) == "running"
    # the same call retried after a lost reply finds its claim; another delivery of the same
    # attempt to the same worker (a re-sent or redelivered message) does not
    assert not isinstance(store.claim("a2", 2, "w1", time.time(), token="call-1"), str)
    assert store.claim("a2", 2, "w1", time.time()) == "running"
    assert store.complete("a2", "{}", OK) is True
    assert store.complete("a2", "{}", OK) is False


def test_resubmitting_the_same_action_is_idempotent(redis_url: str) -> None:
    """The same action submitted twice (a retry after a lost reply) is enqueued once."""
    store = Store(redis_url)
    _submit(store, "a3")
    store.submit([("a3", "{}", '{"p": 1}')], max_queued=0)
    assert store.r.xlen("tangram:intake") == 1


def test_submit_is_refused_with_admission_error_when_redis_memory_is_high(redis_url: str) -> None:
    """With Redis above the admission share of its maxmemory, submit raises AdmissionError and
    enqueues nothing; once memory is back under it, submits go through again."""
    from tangram_celery.common.errors import AdmissionError

    store = Store(redis_url)
    used = int(store.r.info("memory")["used_memory"])
    old = store.r.config_get("maxmemory")["maxmemory"]
    try:
        store.r.config_set("maxmemory", str(int(used / 0.5)))  # now at ~50% of the ceiling
        with pytest.raises(AdmissionError, match="broker full"):
            store.submit([("m1", "{}", "{}")], max_queued=0, admit_memory_fraction=0.4)
        assert store.r.xlen("tangram:intake") == 0 and not store.r.exists(akey("m1"))
        store._mem_checked_s = float("-inf")
        store.submit([("m1", "{}", "{}")], max_queued=0, admit_memory_fraction=0.9)
        assert store.r.xlen("tangram:intake") == 1
    finally:
        store.r.config_set("maxmemory", old)


def test_an_oom_refusal_from_redis_itself_is_an_admission_error(redis_url: str) -> None:
    """When Redis refuses the write at its ceiling (noeviction), submit raises AdmissionError."""
    from tangram_celery.common.errors import AdmissionError

    store = Store(redis_url)
    old = store.r.config_get("maxmemory")["maxmemory"]
    try:
        store.r.config_set("maxmemory", "1")
        with pytest.raises(AdmissionError, match="maxmemory"):
            store.submit([("m2", "{}", "{}")], max_queued=0, admit_memory_fraction=0.95)
    finally:
        store.r.config_set("maxmemory", old)


def test_queued_payload_expires_and_its_claim_reports_it(redis_url: str) -> None:
    """A payload queued longer than its TTL expires; a claim of a re-created record without a
    payload says 'expired' (the worker then finishes the action as rejected)."""
    store = Store(redis_url)
    store.submit([("e1", "{}", '{"p": 1}')], max_queued=0, ttl_s=1)
    assert 0 < store.r.ttl(akey("e1")) <= 1
    time.sleep(1.5)
    assert not store.r.exists(akey("e1"))
    dispatch(store, "e1", 1)  # what dispatch writes
    assert store.claim("e1", 1, "w", time.time()) == "expired"


def test_completion_drops_the_payload_but_resubmission_stays_idempotent(redis_url: str) -> None:
    """Once done the payload is deleted (broker memory), a claimed action has no TTL until its
    result, and a late retry of the original submit is still recognised as the same action."""
    store = Store(redis_url)
    meta = _meta("d1")
    store.submit([("d1", meta, '{"p": 1}')], max_queued=0, ttl_s=600)
    dispatch(store, "d1", 1)
    assert not isinstance(store.claim("d1", 1, "w", time.time()), str)
    assert store.r.ttl(akey("d1")) == -1
    store.complete("d1", '{"status": "ok"}', OK)
    assert not store.r.hexists(akey("d1"), "payload")
    store.submit([("d1", meta, '{"p": 1}')], max_queued=0)  # no error: same digest
    from tangram_celery.common.errors import ActionRejected

    with pytest.raises(ActionRejected):
        store.submit([("d1", meta, '{"p": 2}')], max_queued=0)


def test_a_read_result_is_kept_minutes_and_an_unread_one_a_day(redis_url: str) -> None:
    """Given two completed actions, when a client reads the result of one, then that one is kept
    `READ_TTL_S` more (broker memory follows the rate of results times minutes, not a day) and
    can still be read again meanwhile, while the unread one keeps its day for a caller that
    died before reading it."""
    from tangram_celery.store import READ_TTL_S, RESULT_TTL_S

    store = Store(redis_url)
    for i in ("r1", "r2"):
        _submit(store, i)
        dispatch(store, i, 1)
        assert not isinstance(store.claim(i, 1, "w", time.time()), str)
        store.complete(i, '{"status": "ok"}', OK)
    assert store.r.ttl(akey("r1")) > READ_TTL_S
    assert store.wait_result("r1", timeout_s=10) == '{"status": "ok"}'
    assert 0 < store.r.ttl(akey("r1")) <= READ_TTL_S
    assert store.wait_result("r1", timeout_s=10) == '{"status": "ok"}'  # a second read
    assert RESULT_TTL_S - 60 < store.r.ttl(akey("r2")) <= RESULT_TTL_S
