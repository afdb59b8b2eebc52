"""The sandbox interface the CPU worker talks to.

A sandbox backend runs one `ExecRequest` for a trajectory on the cores it is given and returns
an `ExecResult`. The user's failures (non-zero exit, timeout, memory limit, ...) are statuses in
the result; `SandboxError` is raised only when the backend itself is broken.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Protocol

from tangram_celery.common.actions import ActionStatus, CodeAction, PhaseOutcome, TestCase, TestOutcome
from tangram_celery.common.wire import SandboxOrder, TaskOrder


@dataclass
class ExecRequest:
    """One code action as the sandbox sees it. `cores` are host core ids to bind to."""

    language: str
    code: str | None
    files: dict[str, str] = field(default_factory=dict)
    binary_files: dict[str, str] = field(default_factory=dict)  # path -> base64
    fetch_files: list[str] = field(default_factory=list)  # returned base64 in ExecResult.files
    test_command: str | None = None
    test_cases: list[TestCase] = field(default_factory=list)
    stdin: str | None = None
    timeout_s: float = 10.0
    memory_mb: int = 512
    cores: tuple[int, ...] = (0,)
    env: dict[str, str] = field(default_factory=dict)  # extra env for user code (allowlist)
    max_output_bytes: int | None = None  # cap per stream; None = the sandbox config's
    compile_timeout_s: float = 10.0  # the compile phase's own limit; timeout_s starts after it
    # The scheduler's generation of the trajectory's sandbox ("": no expectation, as for direct
    # use). A sandbox of another generation is stale and replaced; `new_sandbox`: the scheduler
    # pinned the trajectory with this action, so no sandbox is expected (otherwise finding none
    # means it was lost, and the result says `sandbox_reset`).
    sandbox_gen: str = ""
    new_sandbox: bool = False
    # names the action while it runs, for `Sandbox.resize` ("": it cannot be resized)
    action_id: str = ""
    # a time sharer's sandbox CPU weight relative to the default while it runs, restored after
    # (`scheduler.policies.time_share`: it shares `cores` with the action that holds them)
    cpu_weight: float | None = None
    # The verifiers that judge this action's assert tests may judge those of later occupants of
    # the sandbox that name the same group, and no others ("": this occupant's only; the worker
    # names the action's job, `SandboxConfig.verifier_scope`)
    verifier_group: str = ""
    # the trajectory's container image (None: the host-toolchain sandbox)
    image: str | None = None
    # bash code run in the trajectory's persistent shell session (tangram_runner/session.py)
    session: bool = False
    # judge the trajectory's files in a fresh sandbox of its image (`Sandbox.grade`)
    grade: bool = False

    @classmethod
    def of(
        cls,
        action: CodeAction,
        order: TaskOrder,
        cores: tuple[int, ...] | None = None,
        verifier_scope: str = "action",
    ) -> ExecRequest:
        """The request for `action` as the scheduler's `order` runs it: on `cores` (the order's
        own unless the worker's loans changed them), in the trajectory's sandbox generation the
        order names, as a time sharer at the order's CPU weight when it shares its cores
        (`scheduler.policies.time_share`), its assert tests judged by verifiers of the action's
        job when `verifier_scope` (`SandboxConfig.verifier_scope`) is "job"."""
        sandbox = order.sandbox or SandboxOrder()
        return cls(
            **{name: copy.copy(getattr(action, name)) for name in _FROM_ACTION},
            cores=tuple(order.unit_ids) if cores is None else cores,
            sandbox_gen=sandbox.gen,
            new_sandbox=sandbox.new,
            action_id=order.action_id,
            cpu_weight=order.cpu_weight if order.shares else None,
            verifier_group=f"job:{action.job_id}" if verifier_scope == "job" else "",
        )


# The request's fields that are the action's own, copied by name (shallow copies: the worker's
# action stays as it was): a field of CodeAction that the sandbox needs is declared once more
# here, under the same name, and nothing else changes on its way.
_FROM_ACTION = tuple(f.name for f in fields(ExecRequest) if f.name in CodeAction.model_fields)


@dataclass
class ExecResult:
    status: ActionStatus
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    tests: list[TestOutcome] = field(default_factory=list)
    exec_s: float = 0.0  # wall-clock seconds inside the sandbox (what the scheduler learns from)
    detail: str = ""  # why the backend chose the status, when it is not obvious
    compile: PhaseOutcome | None = None  # compile phase, if any; the fields above describe the run
    sandbox_reset: bool = False  # ran in a fresh sandbox although the trajectory had one (files gone)
    files: dict[str, str] = field(default_factory=dict)  # fetch_files: path -> base64
    cpu_s: float | None = None  # CPU seconds the sandbox used while it ran (None: not accounted)
    # the trajectory's files came back from the layer kept when it was evicted (an image's)
    kept_files: bool = False


class Sandbox(Protocol):
    """A backend. Implementations must be safe to call from one worker thread at a time."""

    name: str

    def run(self, trajectory_id: str, request: ExecRequest) -> ExecResult:
        """Run `request` in the trajectory's sandbox, bound to `request.cores`."""
        ...

    def run_once(self, request: ExecRequest) -> ExecResult:
        """Run `request` in a fresh sandbox of its own (a ready one when there is one), which is
        discarded afterwards (a one-shot action)."""
        ...

    def grade(self, trajectory_id: str, request: ExecRequest) -> ExecResult:
        """Run `request` (a test_command and its files) in a fresh one-shot sandbox of the
        trajectory's image holding the trajectory's changes that are not test infrastructure
        (`grading`); the trajectory's own sandbox is left as it is."""
        ...

    def resize(self, action_id: str, cores: tuple[int, ...]) -> bool:
        """Bind the running action `action_id` to `cores` (cpuset and CFS quota) and tell its
        runner the new DoP (a malleable test suite starts or stops case workers). Before the
        action runs, the cores are kept for its start. True when the runner took it."""
        ...

    def close_trajectory(
        self, trajectory_id: str, generation: str | None = None, keep_files: bool = False
    ) -> None:
        """Destroy the trajectory's sandbox and its files (idempotent); with `generation`, only
        a sandbox of that generation (a newer one started since is kept); `keep_files`: an
        eviction: an image's files are kept for the trajectory's next action."""
        ...

    def fork(self, trajectory_id: str, new_ids: list[str]) -> int:
        """Have each of `new_ids` start from a copy of the trajectory's files (in an image)."""
        ...

    def start_prewarm(self) -> None:
        """Start keeping ready sandboxes (`sandbox.prewarm`) in the background."""
        ...

    def held(self) -> list[tuple[str, str]]:
        """(trajectory, generation) of every sandbox this backend holds for a trajectory."""
        ...

    def close(self) -> None:
        """Destroy every sandbox this backend created."""
        ...
