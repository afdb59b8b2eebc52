"""AsyncTangramClient against a live deployment: thousands of outstanding actions on one
connection, results by id, cancel, lost wake-ups."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tangram_celery.common.actions import ApiAction, CodeAction

BIG_API = {
    "apis": [
        {
            "name": "calc",
            "handler": "tangram_celery.apis.builtin:calculator",
            "max_concurrency": 8,
            "quota_per_window": 1_000_000,
            "window_s": 1.0,
        }
    ]
}


@pytest.mark.slow
@pytest.mark.deploy(**BIG_API)
def test_two_thousand_outstanding_actions_from_one_process(deployment: Any) -> None:
    """2,000 actions awaited at once by one client (one listener connection): every result
    arrives, each the right one."""
    from tangram_celery.client.aio import AsyncTangramClient

    async def go() -> tuple[list[Any], int]:
        async with AsyncTangramClient(deployment.url) as client:
            handles = await client.submit_many(
                ApiAction(trajectory_id=f"t{i % 50}", api="calc", request={"expr": f"{i}+1"})
                for i in range(2000)
            )
            waits = [asyncio.ensure_future(h.result(timeout=300)) for h in handles]
            await asyncio.sleep(0)
            peak = client.outstanding
            return list(await asyncio.gather(*waits)), peak

    results, peak = asyncio.run(go())
    assert peak >= 1000  # most were awaited at the same time
    assert [r.status for r in results] == ["ok"] * 2000
    assert [r.output["value"] for r in results] == [i + 1 for i in range(2000)]


def test_results_by_id_cancel_and_lost_wake_ups(deployment: Any) -> None:
    """A result is found by id from another client; cancelling a finished action is refused;
    a result whose wake-up was lost arrives through the listener's sweep."""
    from tangram_celery.client.aio import AsyncTangramClient, UnknownAction
    from tangram_celery.store import Store, notify_key

    async def go() -> None:
        async with (
            AsyncTangramClient(deployment.url, poll_s=0.5) as a,
            AsyncTangramClient(deployment.url) as b,
        ):
            h = await a.submit(CodeAction(trajectory_id="ac1", code="print(7)"))
            res = await b.result(h.id, timeout=60)  # b never submitted it
            assert res.stdout == "7\n"
            assert await a.cancel(h.id) is False
            with pytest.raises(UnknownAction):
                await a.result("no-such-action", timeout=1)
            # the next wake-ups of `a` vanish (what a pop whose reply died with Redis does)
            store = Store(deployment.url)
            h2 = await a.submit(ApiAction(trajectory_id="ac1", api="calc", request={"expr": "1+1"}))
            for _ in range(100):
                store.r.delete(notify_key(a.client_id))
                if store.action_state(h2.id) == "done":
                    store.r.delete(notify_key(a.client_id))
                    break
                await asyncio.sleep(0.05)
            assert (await a.result(h2.id, timeout=30)).output["value"] == 2

    asyncio.run(go())


def test_a_resubmitted_action_answers_without_waiting_for_a_sweep(deployment: Any) -> None:
    """Given an action submitted again (a caller's retry, the same id and content), from the
    client that submitted it or another one, then its result comes when it exists: at once if
    it is done, on its completion if it runs (the retrying client is the one woken), never at
    the next sweep (30 s here) or poll. Both clients, async and blocking."""
    from tangram_celery import TangramClient
    from tangram_celery.client.aio import AsyncTangramClient

    done = CodeAction(trajectory_id="re1", code="print(5)")
    slow = CodeAction(trajectory_id="re2", code="import time; time.sleep(1.5); print(6)")

    async def go() -> list[float]:
        async with (
            AsyncTangramClient(deployment.url, poll_s=30) as a,
            AsyncTangramClient(deployment.url, poll_s=30) as b,
        ):
            assert (await (await a.submit(done)).result(timeout=60)).stdout == "5\n"
            t0 = time.monotonic()
            for client in (a, b):
                assert (await (await client.submit(done)).result(timeout=60)).stdout == "5\n"
            t_done = time.monotonic() - t0
            await a.submit(slow)
            await asyncio.sleep(0.3)  # it runs (a sleep of 1.5 s)
            t0 = time.monotonic()
            assert (await (await b.submit(slow)).result(timeout=60)).stdout == "6\n"
            return [t_done, time.monotonic() - t0]

    t_done, t_running = asyncio.run(go())
    assert t_done < 5 and t_running < 15, (t_done, t_running)
    sync = TangramClient(deployment.url)
    try:
        t0 = time.monotonic()
        assert sync.submit(done).result(timeout=60).stdout == "5\n"
        assert sync.handle(done.id).result(timeout=60).stdout == "5\n"
        assert time.monotonic() - t0 < 1.5  # (it polls every 2 s)
    finally:
        sync.close()


def test_results_the_async_client_hands_out_are_kept_minutes(deployment: Any) -> None:
    """Given results the asyncio client received (woken for its own submits, or found by id for
    another client's), then its listener gives each `READ_TTL_S` instead of a day; a result no
    client received keeps its day."""
    from tangram_celery import TangramClient
    from tangram_celery.client.aio import AsyncTangramClient
    from tangram_celery.store import READ_TTL_S, RESULT_TTL_S, Store, akey

    store = Store(deployment.url)
    with TangramClient(deployment.url) as other:
        theirs, unread = (
            other.submit(ApiAction(trajectory_id="ttl", api="calc", request={"expr": f"{i}+1"})).id
            for i in range(2)
        )

    async def go() -> str:
        async with AsyncTangramClient(deployment.url, poll_s=0.2) as a:
            h = await a.submit(ApiAction(trajectory_id="ttl", api="calc", request={"expr": "5+1"}))
            assert (await h.result(timeout=60)).ok
            assert (await a.result(theirs, timeout=60)).ok
            await asyncio.sleep(0.5)  # the listener's next turn
            return h.id

    mine = asyncio.run(go())
    deadline = time.monotonic() + 30
    while store.action_state(unread) != "done":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for i in (mine, theirs):
        assert 0 < store.r.ttl(akey(i)) <= READ_TTL_S, i
    assert READ_TTL_S < store.r.ttl(akey(unread)) <= RESULT_TTL_S


def test_a_submit_is_one_round_trip_and_survives_a_flushed_script_cache(redis_url: str) -> None:
    """Submitting sends the submit script by digest only (no SCRIPT EXISTS before it: one round
    trip per submit, alone or in a batch). After the script cache is flushed (what a restarted
    Redis has), the next submits load it once and enqueue each action exactly once."""
    import redis

    from tangram_celery.client.aio import AsyncTangramClient
    from tangram_celery.store import INTAKE, SUBMIT

    r = redis.Redis.from_url(redis_url)
    r.script_load(SUBMIT)  # as any earlier client of this Redis would have
    r.config_resetstat()

    def script_calls() -> int:
        return _script_calls(r)

    async def go() -> list[str]:
        async with AsyncTangramClient(redis_url) as c:
            ids = [(await c.submit(ApiAction(api="calc", request={"expr": "1"}))).id for _ in range(3)]
            ids += [h.id for h in await c.submit_many(ApiAction(api="calc") for _ in range(3))]
            assert script_calls() == 0
            r.script_flush()
            ids.append((await c.submit(ApiAction(api="calc"))).id)
            r.script_flush()
            ids += [h.id for h in await c.submit_many(ApiAction(api="calc") for _ in range(2))]
            assert script_calls() == 2 + 2  # two flushes, two loads
            return ids

    ids = asyncio.run(go())
    entries = r.xrange(INTAKE)
    assert sorted(e[b"id"].decode() for _, e in entries) == sorted(ids)
    assert len(ids) == 9


def test_each_waiter_of_one_action_times_out_or_wakes_on_its_own(redis_url: str) -> None:
    """Two result() calls on one action: the one with a short timeout raises ResultTimeout and
    leaves the other waiting; the outcome (here a cancel from another client) wakes it."""
    from tangram_celery.client.aio import AsyncTangramClient
    from tangram_celery.common.errors import ResultTimeout

    async def go() -> None:
        async with AsyncTangramClient(redis_url) as a, AsyncTangramClient(redis_url) as b:
            h = await a.submit(ApiAction(trajectory_id="w1", api="calc"))
            patient = asyncio.ensure_future(a.result(h.id, timeout=30))
            with pytest.raises(ResultTimeout):
                await a.result(h.id, timeout=0.2)
            assert not patient.done()
            assert await b.cancel(h.id, "test") is True
            res = await patient
            assert res.status == "cancelled" and res.action_id == h.id
            assert a.outstanding == 0

    asyncio.run(go())


def test_the_blocking_client_submits_in_one_round_trip_too(redis_url: str) -> None:
    """TangramClient (the blocking one) submits by digest only as well, and after a flushed
    script cache still enqueues each action exactly once."""
    import redis

    from tangram_celery import TangramClient
    from tangram_celery.store import INTAKE, SUBMIT

    r = redis.Redis.from_url(redis_url)
    r.script_load(SUBMIT)
    r.config_resetstat()
    client = TangramClient(redis_url)
    try:
        ids = [client.submit(ApiAction(api="calc")).id for _ in range(3)]
        assert _script_calls(r) == 0
        r.script_flush()
        ids += [h.id for h in client.submit_many(ApiAction(api="calc") for _ in range(2))]
    finally:
        client.close()
    assert _script_calls(r) == 2  # the flush, one load
    assert sorted(e[b"id"].decode() for _, e in r.xrange(INTAKE)) == sorted(ids)


def _script_calls(r: Any) -> int:
    """SCRIPT calls so far (Redis 7 counts each subcommand apart: `cmdstat_script|load`...)."""
    stats = r.info("commandstats")
    return sum(int(v.get("calls", 0)) for k, v in stats.items() if str(k).startswith("cmdstat_script"))
