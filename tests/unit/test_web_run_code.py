"""`POST /run_code` in the app, in front of a stand-in client: the fast path answers exactly as
FastAPI's route does, hands what it cannot validate to the route, and the deadline of a call
counts the caller's compile timeout as queueing time when there is no compile phase."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.config import parse_config
from tangram_celery.common.errors import BrokerError, ResultTimeout
from tangram_celery.common.wire import ActionResult

pytest.importorskip("fastapi")


class Handle:
    def __init__(self, action_id: str) -> None:
        self.id = action_id


class StandIn:
    """What the server needs of AsyncTangramClient; every action is answered `print(1)`, or,
    with `start=False`, never starts (and is cancelled at its latest start)."""

    outstanding = 0

    def __init__(self, *, start: bool = True, broker_down: bool = False) -> None:
        self.start = start
        self.broker_down = broker_down
        self.submitted: list[Any] = []
        self.waits: list[float | None] = []
        self.cancelled: list[str] = []

    async def languages(self) -> dict[str, list[str]]:
        return {"n0": ["python", "c"]}

    async def submit(self, action: Any) -> Handle:
        if self.broker_down:
            raise BrokerError("submit: Redis at redis://x unreachable")
        self.submitted.append(action)
        return Handle(action.id)

    async def result(self, action_id: str, timeout: float | None = 60.0) -> ActionResult:
        self.waits.append(timeout)
        if not self.start:
            raise ResultTimeout("not started")
        return ActionResult(
            action_id=action_id, status=ActionStatus.OK, stdout="1\n", exit_code=0, node="n0", units=1
        )

    async def cancel(self, action_id: str, reason: str = "") -> bool:
        self.cancelled.append(action_id)
        return True

    async def close(self) -> None:
        pass


def _app(client: StandIn, **http: Any) -> Any:
    from tangram_celery.client.gate import Gate
    from tangram_celery.web.app import ServerState, create_app

    cfg = parse_config({"http": {"auth": "none", "allowed_hosts": ["t"], **http}})
    app = create_app(cfg, "redis://unused", client=client)  # type: ignore[arg-type]
    gate = Gate(client, cfg.http)  # type: ignore[arg-type]
    app.state.tangram = ServerState(cfg=cfg, client=client, gate=gate, default_memory_mb=256)  # type: ignore[arg-type]
    return app


def _post(
    app: Any, body: bytes, content_type: str | None = "application/json"
) -> tuple[int, Any, dict[str, str]]:
    import httpx

    headers = {"content-type": content_type} if content_type else {}

    async def go() -> tuple[int, Any, dict[str, str]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/run_code", content=body, headers=headers)
            return r.status_code, r.json(), dict(r.headers)

    return asyncio.run(go())


def _count_fast(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many requests the fast path answered (its calls that returned an answer)."""
    import tangram_celery.web.app as web_app

    answered: list[int] = []
    real = web_app.run_code_fast

    async def spy(scope: Any, body: bytes) -> Any:
        answer = await real(scope, body)
        if answer is not None:
            answered.append(answer.status_code)
        return answer

    monkeypatch.setattr(web_app, "run_code_fast", spy)
    return answered


def test_the_fast_path_answers_as_the_route_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSON request that validates is answered by the fast path; the same request through
    FastAPI's route (a JSON media type the fast path leaves to it) gets the same status and
    the same JSON, field for field, apart from the action's own id."""
    answered = _count_fast(monkeypatch)
    app = _app(StandIn())
    body = json.dumps({"code": "print(1)", "language": "python", "trajectory_id": "t1"}).encode()
    fast = _post(app, body)
    assert answered == [200]
    route = _post(app, body, "application/vnd.tangram+json")
    assert answered == [200]  # not the fast path
    assert fast[0] == route[0] == 200
    assert fast[2]["content-type"] == route[2]["content-type"] == "application/json"
    for answer in (fast[1], route[1]):
        assert answer["tangram"].pop("action_id")
    assert fast[1] == route[1]
    assert fast[1]["status"] == "Success" and fast[1]["run_result"]["stdout"] == "1\n"


def test_what_does_not_validate_gets_fastapi_s_own_422(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invalid JSON, a wrong field type or a missing field: the body is replayed to the route,
    which answers FastAPI's 422 with its error list; a body FastAPI does not read as JSON
    (curl -d sends a form type) is its business too."""
    answered = _count_fast(monkeypatch)
    app = _app(StandIn())
    status, body, _ = _post(app, b'{"code": 1}')
    assert status == 422
    assert {(e["loc"][-1], e["type"]) for e in body["detail"]} == {
        ("code", "string_type"),
        ("language", "missing"),
    }
    status, body, _ = _post(app, b"{not json")
    assert status == 422 and body["detail"][0]["type"] == "json_invalid"
    ok = json.dumps({"code": "print(1)", "language": "python"}).encode()
    status, _, _ = _post(app, ok, "application/x-www-form-urlencoded")
    assert status == 422
    assert answered == []


def test_the_fast_path_keeps_the_refusals_and_their_statuses() -> None:
    """An unknown language is 400 (SandboxError body), a full server the overload status with
    Retry-After, a broker away 503 with Retry-After: as on the route."""
    app = _app(StandIn())
    status, body, _ = _post(app, json.dumps({"code": "x", "language": "cobol"}).encode())
    assert status == 400 and body["status"] == "SandboxError" and "cobol" in body["message"]

    full = _app(StandIn(), max_in_flight=1)
    full.state.tangram.gate.in_flight = 1
    status, body, headers = _post(full, json.dumps({"code": "print(1)", "language": "python"}).encode())
    assert status == 504 and headers["retry-after"] == "1"
    assert body["status"] == "SandboxError" and body["tangram"]["status"] == "overloaded"

    away = _app(StandIn(broker_down=True))
    status, body, headers = _post(away, json.dumps({"code": "print(1)", "language": "python"}).encode())
    assert status == 503 and headers["retry-after"] == "1" and "broker unavailable" in body["detail"]


def test_an_interpreted_call_may_queue_for_its_compile_timeout_too() -> None:
    """The answer is due compile + run timeout + slack after the request, whatever the language
    (verl's client waits compile + run + 10 s). A compiled program must start by slack -
    margin; an interpreted one has no compile phase, so it may wait compile_timeout longer.
    One that cannot start by then is cancelled and answered 504."""
    client = StandIn(start=False)
    app = _app(client, slack_s=8.0, exec_margin_s=2.0)
    python = {"code": "print(1)", "language": "python", "compile_timeout": 10, "run_timeout": 5}
    status, body, _ = _post(app, json.dumps(python).encode())
    assert status == 504 and body["tangram"]["status"] == "overloaded"
    assert client.cancelled == [client.submitted[0].id]
    waited = client.waits[0]
    assert waited is not None and 15.0 < waited <= 16.0  # 10 + 8 - 2
    c_code = {"code": "int main(){}", "language": "c", "compile_timeout": 10, "run_timeout": 5}
    status, _, _ = _post(app, json.dumps(c_code).encode())
    waited = client.waits[1]
    assert status == 504 and waited is not None and 5.0 < waited <= 6.0  # 8 - 2
