"""Tangram-native endpoints under /tangram/v1: one program against many test cases in one
action, any action (code, reward, API) with or without waiting, results by id for callers that
poll, cancel, close a trajectory, capabilities.

Without `trajectory_id` an action is a one-shot action (see `Gate.run_one_shot`).

Every request acts as its token's tenant (`tenancy.py`): the ids it names are that tenant's
own, so another tenant's action id is not found (404), never forbidden. A submission the
intake refuses (`AdmissionError`) is 429 when a limit on queued work or rate refused it, 503
when the broker is full, with the reason.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tangram_celery.client.aio import UnknownAction
from tangram_celery.client.gate import Gate, Late, Outcome, Overloaded
from tangram_celery.client.sync import AnyAction
from tangram_celery.common.actions import (
    COMPILED_LANGUAGES,
    ID_PATTERN,
    JOB_PATTERN,
    MAX_CODE_BYTES,
    ApiAction,
    CodeAction,
    Language,
    RewardAction,
    TestCase,
)
from tangram_celery.common.errors import ActionRejected, AdmissionError, ResultTimeout, TangramError
from tangram_celery.common.wire import ActionResult
from tangram_celery.web.sandbox_models import Capabilities

router = APIRouter(prefix="/tangram/v1", tags=["tangram"])
ActionId = Annotated[str, Path(pattern=ID_PATTERN)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# The action models with `trajectory_id` optional (absent: a one-shot action).
class CodeBody(CodeAction):
    trajectory_id: str | None = Field(None, pattern=ID_PATTERN)


class RewardBody(RewardAction):
    trajectory_id: str | None = Field(None, pattern=ID_PATTERN)


class ApiBody(ApiAction):
    trajectory_id: str | None = Field(None, pattern=ID_PATTERN)


ActionBody = Annotated[CodeBody | RewardBody | ApiBody, Field(discriminator="type")]
_MODELS: dict[str, type[CodeAction] | type[RewardAction] | type[ApiAction]] = {
    "code": CodeAction,
    "reward": RewardAction,
    "api": ApiAction,
}


def to_action(body: CodeBody | RewardBody | ApiBody, trajectory_id: str | None) -> AnyAction:
    fields = body.model_dump(exclude={"trajectory_id"})
    return _MODELS[body.type](**fields, trajectory_id=trajectory_id)


class Case(_Body):
    name: str | None = Field(None, pattern=ID_PATTERN, description="default case-<index>")
    stdin: str | None = None
    expected_stdout: str | None = Field(None, description="compared line by line, trailing spaces ignored")
    assert_code: str | None = Field(None, description="Python: run after the code; passes if it exits 0")


class RunTestsRequest(_Body):
    code: str = Field(max_length=MAX_CODE_BYTES)
    language: Language = "python"
    cases: list[Case] = Field(min_length=1, max_length=10_000)
    cpus: int | str = Field(
        "1..4", description="elastic core range: cases run in parallel on the cores granted"
    )
    timeout_s: float = Field(10.0, gt=0, le=3600, description="limit for running every case")
    compile_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="limit of the compile phase (compiled languages), before timeout_s"
    )
    memory_mb: int | None = Field(
        None,
        ge=16,
        le=1 << 20,
        description="the program's memory limit, MiB (a compiler gets at least "
        "sandbox.compile_memory_mb); default: the sandbox default",
    )
    trajectory_id: str | None = Field(None, pattern=ID_PATTERN)
    job_id: str = Field("default", pattern=JOB_PATTERN)
    priority: int = Field(0, ge=-100, le=100)


class CaseOutcome(BaseModel):
    name: str
    passed: bool
    detail: str = ""


class RunTestsResponse(BaseModel):
    status: str = Field(description="Tangram status: ok when every case passed")
    passed: int
    total: int
    cases: list[CaseOutcome]
    stderr: str = Field("", description="compiler diagnostics / stderr of the first case")
    action_id: str
    trajectory_id: str
    queue_s: float
    exec_s: float
    units: int
    node: str
    error: str = ""
    detail: str = Field("", description="why the sandbox chose the status, when not obvious")


class Submitted(BaseModel):
    action_id: str
    trajectory_id: str
    state: str


class Pending(BaseModel):
    action_id: str
    state: str = Field(description="queued | dispatched | running")


class Cancelled(BaseModel):
    action_id: str
    cancelled: bool
    state: str | None


class Problem(BaseModel):
    detail: str
    action_id: str | None = None


def problem(status_code: int, detail: str, action_id: str | None = None, **headers: str) -> JSONResponse:
    return JSONResponse(
        Problem(detail=detail, action_id=action_id).model_dump(),
        status_code=status_code,
        headers=headers or None,
    )


ADMISSION_PREFIX = "intake full: "  # how `Gate` words an AdmissionError


def admission_status(reason: str) -> int:
    """429 for a limit on the tenant's queued work or rate (its own: retry later), 503 when the
    broker itself is full (everyone's)."""
    return 503 if "broker full" in reason else 429


def admission_problem(reason: str, action_id: str | None = None) -> JSONResponse:
    return problem(admission_status(reason), reason, action_id, **{"Retry-After": "1"})


def outcome_response(outcome: Outcome, gate: Gate) -> ActionResult | JSONResponse:
    if isinstance(outcome, Overloaded) and outcome.reason.startswith(ADMISSION_PREFIX):
        return admission_problem(outcome.reason, outcome.action_id)
    if isinstance(outcome, Overloaded):
        return problem(gate.cfg.overload_status, outcome.reason, outcome.action_id, **{"Retry-After": "1"})
    if isinstance(outcome, Late):
        return problem(
            504,
            f"no result {outcome.deadline_s:.1f} s after the request; it may still finish: "
            f"GET /tangram/v1/actions/{outcome.action_id}",
            outcome.action_id,
        )
    return outcome


async def _run(gate: Gate, body: CodeBody | RewardBody | ApiBody, t0: float) -> Outcome:
    budget = body.timeout_s
    if isinstance(body, CodeBody) and body.language in COMPILED_LANGUAGES and body.code is not None:
        budget += body.compile_timeout_s  # the compile phase has its own limit, before the run's
    if body.trajectory_id is None:
        return await gate.run_one_shot(lambda tid: to_action(body, tid), t0=t0, budget_s=budget)
    return await gate.run(to_action(body, body.trajectory_id), t0=t0, budget_s=budget)


def _gate(request: Request) -> Gate:
    """The gate and client of the tenant the request acts as."""
    gate: Gate = request.app.state.tangram.gate_of(request.scope)
    return gate


@router.post(
    "/actions",
    response_model=ActionResult | Submitted,
    responses={
        202: {"model": Submitted},
        400: {"model": Problem},
        429: {"model": Problem},
        503: {"model": Problem},
        504: {"model": Problem},
    },
)
async def submit_action(
    body: ActionBody,
    request: Request,
    wait: bool = Query(
        True, description="wait for the result (false: 202 with the id; poll GET /actions/{id})"
    ),
) -> ActionResult | Submitted | JSONResponse:
    """Submit a code, reward or API action; with `wait` the result, else its id at once."""
    t0 = time.monotonic()
    gate = _gate(request)
    if not gate.admit():
        return problem(gate.cfg.overload_status, f"more than {gate.cfg.max_in_flight} requests in flight")
    try:
        try:
            if wait:
                return outcome_response(await _run(gate, body, t0), gate)
            return await _submit_nowait(gate, body)
        except (ActionRejected, ValidationError, ValueError) as e:
            return problem(400, str(e))
    finally:
        gate.leave()


async def _submit_nowait(gate: Gate, body: CodeBody | RewardBody | ApiBody) -> Submitted | JSONResponse:
    try:  # without a trajectory: a one-shot action, which releases everything when it completes
        handle = await gate.client.submit(to_action(body, body.trajectory_id))
    except AdmissionError as e:
        return admission_problem(f"{ADMISSION_PREFIX}{e}")
    submitted = Submitted(action_id=handle.id, trajectory_id=body.trajectory_id or "", state="queued")
    return JSONResponse(submitted.model_dump(), 202)


@router.get(
    "/actions/{action_id}",
    response_model=ActionResult,
    responses={202: {"model": Pending}, 404: {"model": Problem}},
)
async def get_action(
    action_id: ActionId,
    request: Request,
    wait_s: float = Query(0.0, ge=0, le=60, description="long poll: wait up to this long for the result"),
) -> ActionResult | JSONResponse:
    """An action's result (200), or its state while it is not finished (202)."""
    client = _gate(request).client
    if wait_s > 0:
        try:
            return await client.result(action_id, timeout=wait_s)
        except UnknownAction as e:
            return problem(404, str(e), action_id)
        except ResultTimeout:
            pass
    state, result = await client.peek(action_id)
    if state is None:
        return problem(404, f"no action {action_id!r} (never submitted, or its result expired)", action_id)
    if result is not None:
        return result
    return JSONResponse(Pending(action_id=action_id, state=state).model_dump(), 202)


@router.delete("/actions/{action_id}", response_model=Cancelled, responses={404: {"model": Problem}})
async def cancel_action(action_id: ActionId, request: Request) -> Cancelled | JSONResponse:
    """Cancel an action that has not been dispatched yet (it then never runs)."""
    client = _gate(request).client
    done = await client.cancel(action_id, "cancelled over HTTP")
    state = await client.state(action_id)
    if not done and state is None:
        return problem(404, f"no action {action_id!r} (never submitted, or its result expired)", action_id)
    return Cancelled(action_id=action_id, cancelled=done, state=state)


@router.post("/trajectories/{trajectory_id}/close", status_code=202)
async def close_trajectory(
    trajectory_id: Annotated[str, Path(pattern=ID_PATTERN)], request: Request
) -> dict[str, str]:
    """The trajectory is finished: its sandbox and memory are released once its actions end."""
    await _gate(request).client.close_trajectory(trajectory_id)
    return {"trajectory_id": trajectory_id, "state": "closing"}


class ForkBody(_Body):
    n: int = Field(0, ge=0, le=256, description="new trajectories to make (ids chosen by the server)")
    ids: list[Annotated[str, Field(pattern=ID_PATTERN)]] = Field(
        default_factory=list, max_length=256, description="or: the new trajectories' ids"
    )


class Forked(BaseModel):
    trajectory_id: str
    forks: list[str]


@router.post(
    "/trajectories/{trajectory_id}/fork",
    response_model=Forked,
    responses={400: {"model": Problem}, 409: {"model": Problem}},
)
async def fork_trajectory(
    trajectory_id: Annotated[str, Path(pattern=ID_PATTERN)], body: ForkBody, request: Request
) -> Forked | JSONResponse:
    """New trajectories, each from a copy of this one's files (a trajectory in an image), once
    its earlier actions ran; 409 when the fork could not be made (e.g. not an image's)."""
    client = _gate(request).client
    try:
        forks = await client.fork(trajectory_id, body.n, body.ids or None)
    except ActionRejected as e:
        return problem(400, str(e))
    except TangramError as e:
        return problem(409, str(e))
    return Forked(trajectory_id=trajectory_id, forks=forks)


@router.get("/capabilities", response_model=Capabilities)
async def capabilities(request: Request) -> Capabilities:
    """Languages, reward models, APIs and limits of this deployment."""
    caps: Capabilities = await request.app.state.tangram.capabilities()
    return caps


@router.post(
    "/run_tests",
    response_model=RunTestsResponse,
    responses={400: {"model": Problem}, 504: {"model": Problem}},
)
async def run_tests(req: RunTestsRequest, request: Request) -> RunTestsResponse | JSONResponse:
    """One program against many test cases in ONE action: compiled once, the cases spread over
    the elastic cores the scheduler grants (instead of one request per case)."""
    t0 = time.monotonic()
    state = request.app.state.tangram
    gate = _gate(request)
    from tangram_celery.web.sandbox_fusion import language_refusal

    why = await language_refusal(state, req.language)
    if why is not None:
        return problem(400, why)
    if not gate.admit():
        return problem(gate.cfg.overload_status, f"more than {gate.cfg.max_in_flight} requests in flight")
    try:
        try:
            cases = [
                TestCase(
                    name=c.name or f"case-{i}",
                    stdin=c.stdin,
                    expected_stdout=c.expected_stdout,
                    assert_code=c.assert_code,
                )
                for i, c in enumerate(req.cases)
            ]
            body = CodeBody(
                trajectory_id=req.trajectory_id,
                language=req.language,
                code=req.code,
                test_cases=cases,
                cpus=req.cpus,
                timeout_s=req.timeout_s,
                compile_timeout_s=req.compile_timeout_s,
                memory_mb=req.memory_mb or state.default_memory_mb,
                job_id=req.job_id,
                priority=req.priority,
            )
            outcome = await _run(gate, body, t0)
        except (ActionRejected, ValidationError, ValueError) as e:
            return problem(400, str(e))
        res = outcome_response(outcome, gate)
        if not isinstance(res, ActionResult):
            return res
        return RunTestsResponse(
            status=str(res.status),
            passed=sum(t.passed for t in res.tests),
            total=len(req.cases),
            cases=[CaseOutcome(name=t.name, passed=t.passed, detail=t.detail) for t in res.tests],
            stderr=res.stderr,
            action_id=res.action_id,
            trajectory_id=res.trajectory_id,
            queue_s=res.queue_s,
            exec_s=res.exec_s,
            units=res.units,
            node=res.node,
            error=res.error,
            detail=res.detail,
        )
    finally:
        gate.leave()
