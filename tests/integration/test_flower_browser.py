"""Flower in a real browser: basic auth on by default, workers, tasks and the per-resource queues.

A full local deployment (embedded Redis, scheduler, CPU, API and GPU workers, Flower as `tangram up`
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

from tests.fixtures.common import unavailable
from tests.fixtures.redis import deployment_config
from tests.fixtures.sandbox import require_sandbox
from tests.fixtures.triton import reward_deps_missing


@pytest.fixture
def flower_deployment(tmp_path: Path) -> Iterator[Any]:
    """CPU, API and GPU pools (the GPU node's Triton serves a tiny model the deployment builds)."""
    from tangram_celery.common.config import load_config
    from tangram_celery.deploy import Deployment

    missing = reward_deps_missing()
    if missing:
        unavailable(f"reward dependencies missing: {missing}")
    sandbox = {"backend": "namespace", "default_timeout_s": 10}
    require_sandbox(sandbox)
    path = deployment_config(
        tmp_path,
        sandbox=sandbox,
        flower={"port": 0},
        nodes={
            "cpu": [{"name": "n0", "cores": 2, "memory_mb": 4096}],
            "gpu": [{"name": "g0", "num_gpus": 2, "gpu_memory_mb": 1024}],
        },
        reward_models=[
            {
                "name": "rm",
                "backend": "hf-seq-cls",
                "path": str(tmp_path / "models" / "rm"),
                "build": "tiny-seq-cls",
                "memory_mb": 256,
            }
        ],
    )
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


def _queue_rows(page: Any) -> dict[str, str]:
    """Queue name -> message count, as the broker page's table shows them."""
    rows = page.eval_on_selector_all(
        "#queue-table tbody tr", "rows => rows.map(r => Array.from(r.cells).map(c => c.textContent.trim()))"
    )
    return {r[0]: r[1] for r in rows if len(r) > 1}


@pytest.mark.slow
def test_flower_requires_login_and_shows_workers_tasks_and_queues(
    flower_deployment: Any, browser: Any, tmp_path: Path
) -> None:
    """Given a deployment with CPU, API and GPU pools and Flower, when a browser opens Flower
    without credentials, then 401; when it logs in, then the broker page lists every
    per-resource queue with its length at once (no workers Refresh first; a paused API queue
    shows the messages waiting in it; screenshot saved), the workers of every pool appear, and
    the tasks page names each action's kind and trajectory, so that an action can be found."""
    from tangram_celery import ApiAction, CodeAction, RewardAction, TangramClient
    from tangram_celery.transport.app import make_app

    dep = flower_deployment
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
    app = make_app(dep.url)
    try:
        page = ctx.new_page()
        # The API worker stops consuming for a moment: what the scheduler sends it waits in its
        # queue (less than the scheduler's 20 s claim timeout, so nothing is re-sent).
        api_worker = [n for r in app.control.ping(timeout=5.0) for n in r if n.startswith("api-calc@")]
        assert api_worker
        assert app.control.cancel_consumer(
            "tangram.api.calc", destination=api_worker, reply=True, timeout=5.0
        )
        with TangramClient(dep.url) as client:
            handles = [client.submit(CodeAction(trajectory_id=f"t{k}", code=f"print({k})")) for k in range(3)]
            handles += [
                client.submit(ApiAction(trajectory_id=f"a{k}", api="calc", request={"expr": "6*7"}))
                for k in range(3)
            ]
            handles.append(
                client.submit(RewardAction(trajectory_id="r0", model="rm", inputs={"response": "ok"}))
            )
            broker = _page_shows(
                page,
                f"{dep.flower_url}/broker",
                lambda t: (
                    "tangram.cpu.n0" in t
                    and "tangram.gpu.g0" in t
                    # The scheduler may send the three API actions over more than one round:
                    # wait for all of them rather than for the first.
                    and _queue_rows(page).get("tangram.api.calc", "0") == "3"
                ),
            )
            shot = tmp_path / "flower-broker.png"
            page.screenshot(path=str(shot), full_page=True)
            rows = _queue_rows(page)
            assert {"tangram.cpu.n0", "tangram.gpu.g0", "tangram.api.calc"} <= set(rows), rows
            assert int(rows["tangram.api.calc"]) == 3, rows
            assert "tangram.default" not in broker
            assert shot.stat().st_size > 10_000
            assert app.control.add_consumer(
                "tangram.api.calc", destination=api_worker, reply=True, timeout=5.0
            )
            results = [h.result(timeout=300) for h in handles]
        assert all(r.ok for r in results), results
        workers = _page_shows(
            page,
            f"{dep.flower_url}/workers",
            lambda t: "cpu-n0@" in t and "api-calc@" in t and "gpu-g0@" in t,
        )
        assert "Online" in workers
        ids = [r.action_id for r in results]
        tasks = _page_shows(page, f"{dep.flower_url}/tasks", lambda t: all(i in t for i in ids))
        assert "tangram.run_cpu" in tasks and "tangram.run_api" in tasks and "tangram.run_gpu" in tasks
        for needle in ("kind=code", "trajectory=t1", "kind=api:calc", "trajectory=a2", "kind=reward:rm"):
            assert needle in tasks, needle
        # and one can find it by its trajectory in Flower's task search (which searches the args)
        page.fill("input[type=search]", "trajectory=a2")
        deadline = time.monotonic() + 30
        shown = ""
        while time.monotonic() < deadline:
            shown = page.text_content("#tasks-table tbody") or page.text_content("table tbody") or ""
            if results[5].action_id in shown and all(r.action_id not in shown for r in results[:5]):
                break
            time.sleep(0.5)
        assert results[5].action_id in shown and all(r.action_id not in shown for r in results[:5]), shown
    finally:
        app.close()
        ctx.close()
