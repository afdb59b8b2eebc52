"""Flower in a real browser: basic auth on by default, workers, tasks and the per-resource queues.

A full local deployment (embedded Redis, scheduler, CPU and API workers, Flower as `tangram up`
starts it) runs a few actions; headless Chromium (Debian's package, driven by Playwright) then
looks at Flower the way an operator does.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.redis import deployment_config
from tests.fixtures.sandbox import require_sandbox


@pytest.fixture
def flower_deployment(tmp_path: Path) -> Iterator[Any]:
    from tangram_celery.config import load_config
    from tangram_celery.deploy import Deployment

    sandbox = {"backend": "namespace", "default_timeout_s": 10}
    require_sandbox(sandbox)
    path = deployment_config(tmp_path, sandbox=sandbox, flower={"port": 0})
    dep = Deployment(load_config(path), path, with_flower=True)
    try:
        dep.start(progress=False)
        _wait_http(dep.flower_url, 60)
        yield dep
    finally:
        dep.stop()


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # it answers (401 without credentials)
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"Flower did not answer on {url} within {timeout_s:.0f} s")


def _page_shows(
    page: Any, url: str, wanted: Callable[[str], bool], timeout_s: float = 60, before: str = ""
) -> str:
    """Load `url` until its text satisfies `wanted` (Flower learns from events and inspection;
    `before` is a page to visit first each time, e.g. the workers page's Refresh)."""
    text = ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if before:
            page.goto(before)
        page.goto(url)
        page.wait_for_load_state("networkidle")
        text = page.text_content("body") or ""
        if wanted(text):
            return text
        time.sleep(1.0)
    raise AssertionError(f"{url} never showed what was expected; last text:\n{text[:2000]}")


@pytest.mark.integration
@pytest.mark.slow
def test_flower_requires_login_and_shows_workers_tasks_and_queues(
    flower_deployment: Any, browser: Any
) -> None:
    """Given a deployment with Flower, when a browser opens it without credentials, then 401;
    when it logs in, then the workers of every pool, the actions that ran (by id, as Celery
    tasks) and the per-resource queues appear."""
    from tangram_celery import ApiAction, CodeAction, TangramClient

    dep = flower_deployment
    with TangramClient(dep.url) as client:
        handles = [client.submit(CodeAction(trajectory_id=f"t{k}", code=f"print({k})")) for k in range(3)]
        handles.append(client.submit(ApiAction(trajectory_id="t0", api="calc", request={"expr": "6*7"})))
        results = [h.result(timeout=120) for h in handles]
    assert all(r.ok for r in results), results

    from playwright.sync_api import Error as BrowserError

    anonymous = browser.new_context()
    try:
        page = anonymous.new_page()
        statuses: list[int] = []
        page.on("response", lambda r: statuses.append(r.status))
        with pytest.raises(BrowserError, match="AUTH"):  # Chromium gives up on the 401 challenge
            page.goto(dep.flower_url)
        assert statuses == [401]
    finally:
        anonymous.close()

    user, password = dep.flower_auth
    ctx = browser.new_context(
        http_credentials={"username": user, "password": password}, viewport={"width": 1600, "height": 1000}
    )
    try:
        page = ctx.new_page()
        workers = _page_shows(
            page, f"{dep.flower_url}/workers", lambda t: "cpu-n0@" in t and "api-calc@" in t
        )
        assert "Online" in workers
        ids = [r.action_id for r in results]
        tasks = _page_shows(page, f"{dep.flower_url}/tasks", lambda t: all(i in t for i in ids))
        assert "tangram.run_cpu" in tasks and "tangram.run_api" in tasks
        # The broker page lists the queues the workers consume (found by inspection: Refresh).
        broker = _page_shows(
            page,
            f"{dep.flower_url}/broker",
            lambda t: "tangram.cpu.n0" in t and "tangram.api.calc" in t,
            before=f"{dep.flower_url}/workers?refresh=1",
        )
        assert "tangram.cpu.n0" in broker
    finally:
        ctx.close()
