"""AsyncTangramClient against a live deployment: thousands of outstanding actions on one
connection, results by id, cancel, lost wake-ups."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tangram_celery.actions import ApiAction, CodeAction

pytestmark = pytest.mark.integration

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
    from tangram_celery.aclient import AsyncTangramClient

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
    from tangram_celery.aclient import AsyncTangramClient, UnknownAction
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
