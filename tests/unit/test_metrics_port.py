"""A process whose metrics port is taken keeps serving its pool (tangram_celery.common.metrics.serve)."""

from __future__ import annotations

import socket

import pytest
from prometheus_client import CollectorRegistry

from tangram_celery.common import metrics


def test_a_taken_metrics_port_is_logged_not_fatal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a port another process holds, serving metrics there gives up after a few tries
    with an error in the log instead of raising (which would end a worker)."""
    monkeypatch.setattr(metrics.time, "sleep", lambda s: None)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        metrics.serve(CollectorRegistry(), port)
    assert "not served" in caplog.text
