"""Pure parts of the HTTP front door: config rules, SandboxFusion phase/status mapping, test-case
parsing, and the auth / size guard."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from tangram_celery.common.actions import ActionStatus, PhaseOutcome
from tangram_celery.common.config import HttpConfig, parse_config
from tangram_celery.common.errors import ConfigError
from tangram_celery.common.wire import ActionResult
from tangram_celery.integrations.code_tests import extract_code, parse_ground_truth, to_test_cases
from tangram_celery.web.phases import overall_status, phase_limits, split_phases
from tangram_celery.web.sandbox_models import CommandRunStatus, RunStatus


def _res(status: ActionStatus, **kw: object) -> ActionResult:
    return ActionResult(action_id="a", status=status, **kw)  # type: ignore[arg-type]


def test_a_non_loopback_address_needs_a_token() -> None:
    """Binding the HTTP server beyond loopback without a token is a config error naming the fix."""
    with pytest.raises(ConfigError, match=r"http.token"):
        parse_config({"http": {"address": "0.0.0.0"}})
    assert parse_config({"http": {"address": "0.0.0.0", "token": "${T}"}}).http.token == "${T}"
    assert parse_config({}).http.loopback


def test_the_queue_budget_must_be_positive() -> None:
    """exec_margin_s at or above slack_s would leave no time to queue: refused."""
    with pytest.raises(ConfigError, match="exec_margin_s"):
        parse_config({"http": {"slack_s": 1.0, "exec_margin_s": 1.0}})


def test_the_token_is_taken_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """${VAR} in http.token is expanded at run time; an unset VAR is named."""
    cfg = HttpConfig(token="${TANGRAM_TEST_TOKEN}")
    with pytest.raises(ConfigError, match="TANGRAM_TEST_TOKEN"):
        cfg.resolved_token()
    monkeypatch.setenv("TANGRAM_TEST_TOKEN", "s3cret")
    assert cfg.resolved_token() == "s3cret"


def test_statuses_map_onto_sandbox_fusion_without_new_values() -> None:
    """Every Tangram status maps to SandboxFusion's enums by their rule (limits are a non-zero
    return code, a timeout is TimeLimitExceeded, errors have no phase)."""
    cases = {
        ActionStatus.OK: (RunStatus.Success, CommandRunStatus.Finished, 0),
        ActionStatus.FAILED: (RunStatus.Failed, CommandRunStatus.Finished, 3),
        ActionStatus.TIMEOUT: (RunStatus.Failed, CommandRunStatus.TimeLimitExceeded, None),
        ActionStatus.MEMORY_LIMIT: (RunStatus.Failed, CommandRunStatus.Finished, -9),
        ActionStatus.OUTPUT_LIMIT: (RunStatus.Failed, CommandRunStatus.Finished, -9),
        ActionStatus.PIDS_LIMIT: (RunStatus.Failed, CommandRunStatus.Finished, -9),
        ActionStatus.DISK_LIMIT: (RunStatus.Failed, CommandRunStatus.Finished, -9),
    }
    for status, (overall, phase, rc) in cases.items():
        exit_code = 3 if status is ActionStatus.FAILED else (0 if status is ActionStatus.OK else None)
        compile_result, run = split_phases(_res(status, exit_code=exit_code), "python")
        assert compile_result is None and run is not None
        assert (overall_status(compile_result, run), run.status, run.return_code) == (overall, phase, rc), (
            status
        )
    for status in (ActionStatus.ERROR, ActionStatus.REJECTED, ActionStatus.CANCELLED):
        assert split_phases(_res(status), "python") == (None, None)
        assert overall_status(None, None) is RunStatus.SandboxError


def test_a_failed_compile_phase_has_a_compile_result_and_no_run() -> None:
    """The result's compile phase, not its stderr, decides: a failed compile is compile_result
    (non-zero) and no run_result, whatever the language."""
    diag = "main.cpp:1:1: error: expected unqualified-id\n"
    for lang in ("c", "cpp", "go", "java", "rust"):
        res = _res(
            ActionStatus.FAILED, exit_code=1, stderr=diag, compile=PhaseOutcome(exit_code=1, stderr=diag)
        )
        compile_result, run = split_phases(res, lang)
        assert run is None and compile_result is not None and compile_result.return_code == 1
        assert compile_result.stderr == diag and overall_status(compile_result, run) is RunStatus.Failed
    # a program that fails at run time with compiler-like stderr keeps its run_result
    res = _res(ActionStatus.FAILED, exit_code=1, stderr=diag, compile=PhaseOutcome(exit_code=0), exec_s=2.0)
    compile_result, run = split_phases(res, "cpp")
    assert compile_result is not None and compile_result.return_code == 0
    assert run is not None and run.return_code == 1


def test_a_compile_time_limit_is_a_compile_phase_time_limit() -> None:
    """A compile phase that hit its own limit is compile_result TimeLimitExceeded, no run."""
    res = _res(ActionStatus.TIMEOUT, compile=PhaseOutcome(exit_code=None, timed_out=True, exec_s=3.0))
    compile_result, run = split_phases(res, "java")
    assert run is None and compile_result is not None
    assert compile_result.status is CommandRunStatus.TimeLimitExceeded
    assert overall_status(compile_result, run) is RunStatus.Failed


def test_the_run_phase_time_excludes_the_compile() -> None:
    """run_result.execution_time is the action's time minus its compile phase's."""
    res = _res(ActionStatus.OK, exit_code=0, exec_s=5.0, compile=PhaseOutcome(exit_code=0, exec_s=4.0))
    compile_result, run = split_phases(res, "rust")
    assert compile_result is not None and compile_result.execution_time == 4.0
    assert run is not None and run.execution_time == pytest.approx(1.0)


def test_each_phase_gets_its_own_time_limit() -> None:
    """compile_timeout becomes the compile phase's limit and run_timeout the run's."""
    assert phase_limits("cpp", 5, 7) == {"timeout_s": 7, "compile_timeout_s": 5}
    assert phase_limits("nodejs", 5, 7) == {"timeout_s": 7}
    assert phase_limits("python", 5, 7) == {"timeout_s": 7}


def test_verl_ground_truth_becomes_one_action_of_cases() -> None:
    """inputs/outputs, fn_name and assert_case specs all become test cases of one action."""
    code, cases = to_test_cases(
        "x = 1", parse_ground_truth(json.dumps({"inputs": ["1\n", "2\n"], "outputs": ["1", "2"]}))
    )
    assert [(c.stdin, c.expected_stdout) for c in cases] == [("1\n", "1"), ("2\n", "2")]
    code, cases = to_test_cases("def f(a): return a", {"inputs": ["[1]"], "outputs": ["[1]"], "fn_name": "f"})
    assert "__tangram_call()" in code and cases[0].stdin == "[1]"
    _, cases = to_test_cases("def f(): return 1", {"assert_case": ["assert f() == 1"]})
    assert cases[0].assert_code == "assert f() == 1"
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        to_test_cases("", {"inputs": ["a", "b"], "outputs": ["a"]})
    with pytest.raises(ValueError, match="identifier"):
        to_test_cases("", {"inputs": ["1"], "outputs": ["1"], "fn_name": "f(); import os"})
    assert extract_code("text\n```python\nprint(1)\n```\n") == "\nprint(1)\n"
    assert extract_code("no code here") is None


def _call(
    app: object, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
) -> int:
    import httpx

    async def go() -> int:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.request(method, path, headers=headers, content=body)
            return r.status_code

    return asyncio.run(go())


def test_the_guard_requires_the_token_except_on_ping_and_docs() -> None:
    """With a token, requests without it (or with a wrong one) get 401; ping and the OpenAPI
    docs stay open; the token is accepted as a bearer header, and as ?token= only where the
    operator opts in (verl sends no headers): else 403 (tests/unit/test_http_auth.py)."""
    pytest.importorskip("fastapi")
    from fastapi import FastAPI

    from tangram_celery.web.app import Guard

    inner = FastAPI()

    @inner.post("/run_code")
    async def run_code() -> dict[str, str]:
        return {"ok": "yes"}

    @inner.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    from tangram_celery.common.config_front import HttpConfig
    from tangram_celery.web.auth import Access

    http = HttpConfig(allowed_hosts=("t",))
    app = Guard(inner, access=Access.of(http, "s3cret"), max_body_bytes=1024)
    assert _call(app, "POST", "/run_code") == 401
    assert _call(app, "POST", "/run_code", {"Authorization": "Bearer nope"}) == 401
    assert _call(app, "POST", "/run_code", {"Authorization": "Bearer s3cret"}) == 200
    assert _call(app, "POST", "/run_code?token=s3cret") == 403
    in_query = http.model_copy(update={"token_in_query": True})
    app_q = Guard(inner, access=Access.of(in_query, "s3cret"), max_body_bytes=1024)
    assert _call(app_q, "POST", "/run_code?token=s3cret") == 200
    assert _call(app, "GET", "/v1/ping") == 200
    assert _call(app, "GET", "/openapi.json") == 200
    big = base64.b64encode(b"x" * 2048)
    assert _call(app, "POST", "/run_code", {"Authorization": "Bearer s3cret"}, big) == 413
