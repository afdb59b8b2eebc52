"""Triton's restricted APIs (issue 37): only the holder of the per-start key controls or queries models."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest


def _call(url: str, path: str, headers: dict[str, str] | None = None, body: Any = None) -> int:
    """The HTTP status Triton answers to POST (with `body`) or GET http://url/path."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{url}{path}", data=data, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _infer_body() -> dict[str, Any]:
    row = json.dumps({"response": "hello"})
    return {"inputs": [{"name": "REQUEST", "shape": [1, 1], "datatype": "BYTES", "data": [row]}]}


@pytest.fixture
def served(reward_service: Any) -> tuple[str, str]:
    """(url, a loaded replica's name) of the session's server, after a scored call of Tangram's own."""
    out = reward_service.score("rm", [{"response": "warm"}], chunk=(0,))
    assert "score" in out[0]
    return reward_service.server.url, "rm__dop1__g0"


@pytest.mark.parametrize(
    "headers",
    [None, {"tangram-triton-key": "not-the-key"}, {"tangram-triton-key": ""}],
    ids=["no-header", "wrong-key", "empty-key"],
)
def test_model_control_without_the_key_is_refused(served: tuple[str, str], headers: Any) -> None:
    """Given a running reward server, when a client without the key (or with a wrong one) lists,
    loads, unloads, reads the config of or infers on a model, then Triton refuses every call
    and the replica is still loaded."""
    url, replica = served
    calls = [
        ("/v2/repository/index", {}),
        (f"/v2/repository/models/{replica}/unload", {}),
        ("/v2/repository/models/emb__dop1__g1/load", {}),
        (f"/v2/models/{replica}/infer", _infer_body()),
        (f"/v2/models/{replica}/config", None),
        (f"/v2/models/{replica}", None),
        ("/v2/models/stats", None),
        ("/v2/logging", None),
    ]
    for path, body in calls:
        status = _call(url, path, headers, body)
        assert status in (401, 403), f"{path} answered {status} without the key"
    assert _call(url, f"/v2/models/{replica}/ready") == 200  # health stays open, and it is still loaded


def test_tangrams_own_calls_still_work(reward_service: Any, served: tuple[str, str]) -> None:
    """Given the restricted server, when Tangram lists, unloads, loads and scores through its
    controller, then each call succeeds; the key it sends is the one Triton checks."""
    url, replica = served
    ctl = reward_service.controller
    assert ctl.loaded().get(replica) == "READY"
    assert _call(url, "/v2/repository/index", ctl.headers, {}) == 200
    out = reward_service.score("rm", [{"response": "one"}, {"response": "two"}], chunk=(0,))
    assert len(out) == 2 and all("score" in r for r in out)


def test_the_key_is_new_at_each_start_and_not_in_the_log(reward_service: Any) -> None:
    """Given the server, then its key is long, its controller holds that key, and Triton's log
    does not print it (the restart path is `test_triton_server::test_crash_is_detected...`)."""
    info = reward_service.server.info
    assert len(info.api_key) >= 32
    assert reward_service.controller.api_key == info.api_key
    assert info.api_key not in reward_service.server.log_tail(lines=10_000)
