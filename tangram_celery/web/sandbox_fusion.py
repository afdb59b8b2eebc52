"""SandboxFusion-compatible endpoints: GET /v1/ping, POST /run_code, GET /v1/capabilities.

A `/run_code` call becomes one CodeAction: with `trajectory_id` it runs in that trajectory's
sandbox (files persist across calls), without it as a one-shot action. Its result maps onto
SandboxFusion's phases and statuses (`phases.py`); the exact Tangram status travels in the
extra key `tangram`. Refusals (unknown language, bad files, a request Tangram can never run)
are SandboxFusion-shaped too: status SandboxError with a message saying what to change.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.types import Scope

from tangram_celery.client.gate import Gate, Late, Outcome, Overloaded
from tangram_celery.common.actions import CodeAction
from tangram_celery.common.errors import ActionRejected, BrokerError, TangramError
from tangram_celery.common.wire import ActionResult
from tangram_celery.web.phases import (
    COMPILED,
    LANGUAGES,
    action_budget_s,
    overall_status,
    phase_limits,
    split_phases,
)
from tangram_celery.web.sandbox_models import (
    Capabilities,
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
    TangramExtras,
    TangramInfo,
)

router = APIRouter()
log = logging.getLogger(__name__)


def refusal(message: str, status: str = "rejected", **info: Any) -> RunCodeResponse:
    return RunCodeResponse(
        status=RunStatus.SandboxError,
        message=message,
        tangram=TangramInfo(status=status, error=message, **info),
    )


# Tangram's extras of `/run_code`, passed to CodeAction by name (`TangramExtras`)
_EXTRAS: set[str] = set(TangramExtras.model_fields)  # read only


def to_action(req: RunCodeRequest, trajectory_id: str, default_memory_mb: int) -> CodeAction:
    """The CodeAction of a `/run_code` request (raises ValueError / ValidationError)."""
    fields: dict[str, Any] = {
        "trajectory_id": trajectory_id,
        "language": req.language,
        "code": req.code,
        "stdin": req.stdin,
        # SandboxFusion's files are base64: written as bytes, as they come
        "binary_files": {path: b64 for path, b64 in req.files.items() if b64 is not None},
        "fetch_files": list(req.fetch_files),
        "memory_mb": req.memory_limit_MB if req.memory_limit_MB > 0 else default_memory_mb,
        **req.model_dump(include=_EXTRAS),
        **phase_limits(req.language, req.compile_timeout, req.run_timeout),
    }
    return CodeAction(**fields)


@dataclass(frozen=True)
class Answer:
    """A `/run_code` answer, serialised once: served as is by the route and by the fast path."""

    status_code: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, response: RunCodeResponse, status_code: int = 200, **headers: str) -> Answer:
        return cls(status_code, _TO_JSON(response), tuple(headers.items()))


_TO_JSON = RunCodeResponse.__pydantic_serializer__.to_json


def to_response(outcome: Outcome, language: str, overload_status: int) -> Answer:
    if isinstance(outcome, Overloaded):
        body = refusal(outcome.reason, status="overloaded", action_id=outcome.action_id)
        return Answer.of(body, overload_status, **{"Retry-After": "1"})
    if isinstance(outcome, Late):
        return Answer.of(
            refusal(
                f"action {outcome.action_id} had no result {outcome.deadline_s:.1f} s after the "
                f"request; it may still finish: GET /tangram/v1/actions/{outcome.action_id}",
                status="deadline",
                action_id=outcome.action_id,
            )
        )
    return Answer.of(from_result(outcome, language))


def from_result(result: ActionResult, language: str) -> RunCodeResponse:
    compile_result, run_result = split_phases(result, language)
    status = overall_status(compile_result, run_result)
    message = result.error if status is RunStatus.SandboxError else ""
    if status is RunStatus.SandboxError and not message:
        message = f"action {result.action_id} ended with status {result.status}"
    return RunCodeResponse(
        status=status,
        message=message,
        compile_result=compile_result,
        run_result=run_result,
        executor_pod_name=result.node or None,
        files=result.files,
        tangram=TangramInfo(
            status=str(result.status),
            action_id=result.action_id,
            trajectory_id=result.trajectory_id,
            queue_s=result.queue_s,
            exec_s=result.exec_s,
            act_s=result.act_s,
            units=result.units,
            node=result.node,
            attempts=result.attempts,
            error=result.error,
        ),
    )


@router.get("/v1/ping", tags=["sandbox-fusion"])
async def ping() -> str:
    """Liveness, as SandboxFusion answers it: the JSON string "pong"."""
    return "pong"


@router.get("/v1/capabilities", response_model=Capabilities, tags=["sandbox-fusion"])
async def capabilities(request: Request) -> Capabilities:
    """Languages (and pools) this deployment runs: the languages are those the CPU workers
    reported their sandboxes have toolchains for."""
    return await request.app.state.tangram.capabilities()


@router.post("/run_code", response_model=RunCodeResponse, tags=["sandbox-fusion"])
async def run_code(req: RunCodeRequest, request: Request) -> Response:
    """Run one program, SandboxFusion-compatible. Overload: HTTP 504 (configurable), and the
    action never runs."""
    # Requests with a JSON body that validates are answered by `run_code_fast` before they
    # reach FastAPI; this route serves the rest (and documents the endpoint).
    answer = await run_code_answer(req, request.app.state.tangram, request.scope)
    return Response(answer.body, answer.status_code, dict(answer.headers), media_type="application/json")


async def run_code_fast(scope: Scope, body: bytes) -> Answer | None:
    """The answer to a `/run_code` request body, without FastAPI's request machinery (routing,
    dependency solving, a JSON parse and a second validation pass: a fifth of the server's time
    per call); None when the body does not validate, so that the route answers it with
    FastAPI's own 422."""
    state = getattr(getattr(scope.get("app"), "state", None), "tangram", None)
    if state is None:  # not inside the server's app (or before its start): the route decides
        return None
    try:
        req = RunCodeRequest.model_validate_json(body)
    except ValidationError:
        return None
    return await run_code_answer(req, state, scope)


async def run_code_answer(req: RunCodeRequest, state: Any, scope: Scope) -> Answer:
    """The answer to a `/run_code` request, acting as the tenant of the request (`scope`)."""
    t0 = time.monotonic()
    gate: Gate = state.gate_of(scope)
    why = await language_refusal(state, req.language)
    if why is not None:  # refused before anything is queued; HTTP 400, SandboxFusion-shaped
        return Answer.of(refusal(why), 400)
    if not gate.admit():
        return to_response(
            Overloaded(f"more than {gate.cfg.max_in_flight} requests in flight"),
            req.language,
            gate.cfg.overload_status,
        )
    try:
        budget = action_budget_s(req.language, req.compile_timeout, req.run_timeout)
        # what the caller's timeouts grant, compile phase or not (verl waits this + 10 s)
        wait = req.compile_timeout + req.run_timeout

        try:  # validated once, before anything is enqueued
            base = to_action(req, req.trajectory_id or "one-shot", state.default_memory_mb)
        except (ValueError, ValidationError) as e:
            return Answer.of(refusal(f"invalid request: {_short(e)}"))

        def make(trajectory_id: str | None) -> CodeAction:
            return base.model_copy(update={"trajectory_id": trajectory_id})

        try:
            if req.trajectory_id is None:
                outcome = await gate.run_one_shot(make, t0=t0, budget_s=budget, wait_s=wait)
            else:
                outcome = await gate.run(base, t0=t0, budget_s=budget, wait_s=wait)
        except ActionRejected as e:
            return Answer.of(refusal(str(e)))
        except BrokerError:
            raise  # 503 with Retry-After, by the caller
        except TangramError as e:  # the client's own failure (an unreadable or vanished result)
            log.exception("run_code: action of trajectory %r failed in the client", req.trajectory_id)
            return Answer.of(refusal(f"{type(e).__name__}: {e}", status="error"))
        return to_response(outcome, req.language, gate.cfg.overload_status)
    finally:
        gate.leave()


async def language_refusal(state: Any, language: str) -> str | None:
    """Why this deployment cannot run `language` (unknown to Tangram, or no CPU node's sandbox
    has its toolchain), or None. Until a CPU worker has reported, only the name is checked."""
    if language not in LANGUAGES:
        return (
            f"language {language!r} is not supported by Tangram (supported: {', '.join(LANGUAGES)}; "
            "GET /v1/capabilities lists what this deployment runs)"
        )
    offered = await state.offered_languages()
    if offered is not None and language not in offered:
        return (
            f"language {language!r} is not available on this deployment: no CPU node's sandbox has "
            f"its toolchain (available: {', '.join(offered) or 'none'}; GET /v1/capabilities)"
        )
    return None


def _short(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}" for err in e.errors()
        )
    return str(e)


__all__ = ["COMPILED", "Answer", "language_refusal", "router", "run_code_fast"]
