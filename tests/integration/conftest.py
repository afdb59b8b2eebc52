"""Fixtures for end-to-end tests: a full local deployment with real processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.redis import deployment_config
from tests.fixtures.sandbox import require_sandbox

RECORD_API = {
    "name": "rec",
    "handler": "tests.integration.support:record",
    "max_concurrency": 4,
    "quota_per_window": 100000,
    "window_s": 1.0,
}


def _deployment(tmp_path: Path, request: pytest.FixtureRequest, with_http: bool) -> Iterator[object]:
    from tangram_celery.common.config import load_config
    from tangram_celery.deploy import Deployment

    marker = request.node.get_closest_marker("deploy")
    overrides = dict(marker.kwargs) if marker else {}
    path = deployment_config(tmp_path, **overrides)
    cfg = load_config(path)
    if cfg.nodes.cpu:
        require_sandbox(cfg.sandbox.model_dump(mode="json"))
    dep = Deployment(cfg, path, with_flower=False, with_http=with_http)
    try:
        dep.start(progress=False)
    except Exception:
        dep.stop()
        raise
    yield dep
    dep.stop()


@pytest.fixture
def deployment(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[object]:
    """A running deployment (Redis, scheduler, workers); overrides via @pytest.mark.deploy(...)."""
    yield from _deployment(tmp_path, request, with_http=False)


@pytest.fixture
def http_deployment(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[object]:
    """A running deployment with its HTTP server (`tangram serve`; URL in `.http_url`)."""
    pytest.importorskip("fastapi", reason="the HTTP server needs the 'http' extra")
    yield from _deployment(tmp_path, request, with_http=True)


@pytest.fixture
def client(deployment: object) -> Iterator[object]:
    from tangram_celery import TangramClient

    c = TangramClient(deployment.url)  # type: ignore[attr-defined]
    yield c
    c.close()
