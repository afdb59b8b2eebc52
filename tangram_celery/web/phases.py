"""Compile and run phases: a SandboxFusion call's time limits into a CodeAction, and a Tangram
result back into SandboxFusion's compile_result / run_result and overall status.

Two seams, each one function, to switch when the runner reports phases itself (the runner
redesign adds `CodeAction.compile_timeout_s` and `ActionResult.compile`):
  * `phase_limits` - today one wall-clock limit covers compile + run of a C program;
  * `split_phases` - today a C compile failure is recognised from what the result shows.
"""

from __future__ import annotations

import re
from typing import Any

from tangram_celery.actions import ActionResult, ActionStatus
from tangram_celery.web.sandbox_models import CommandRunResult, CommandRunStatus, RunStatus

LANGUAGES = ("python", "bash", "c")
COMPILED = frozenset({"c"})
SIGKILL_RC = -9  # how SandboxFusion reports a process killed by a signal (OOM, limits)

# gcc / ld diagnostics about the unit the runner compiles (main.c): what a failed compile of
# today's runner leaves in stderr, with the compiler's exit code 1.
_COMPILE_DIAG = re.compile(
    r"^(main\.c:\d+(:\d+)?: (fatal )?error:|collect2: error:|.*undefined reference to)", re.M
)


def phase_limits(language: str, compile_timeout_s: float, run_timeout_s: float) -> dict[str, Any]:
    """CodeAction fields for a call's compile and run time limits. Until the runner times the
    phases apart, a compiled program gets one limit for both (their sum)."""
    if language in COMPILED:
        return {"timeout_s": min(compile_timeout_s + run_timeout_s, 3600.0)}
    return {"timeout_s": run_timeout_s}


def action_budget_s(language: str, compile_timeout_s: float, run_timeout_s: float) -> float:
    """The longest an action may run once started (the deadline logic keeps this much room)."""
    return compile_timeout_s + run_timeout_s if language in COMPILED else run_timeout_s


def _compile_failed(result: ActionResult) -> bool:
    return (
        result.status is ActionStatus.FAILED
        and result.exit_code == 1
        and not result.stdout
        and bool(_COMPILE_DIAG.search(result.stderr))
    )


def split_phases(
    result: ActionResult, language: str
) -> tuple[CommandRunResult | None, CommandRunResult | None]:
    """(compile_result, run_result) of a finished code action, in SandboxFusion's terms.

    SandboxFusion has no status for resource limits: a memory, process, output or disk limit
    is a run that finished with a non-zero return code (the signal's -9 when the process
    itself exited 0 or was killed), exactly as an OOM shows there. Infrastructure errors and
    refusals have no phase (overall SandboxError)."""
    if result.status in (ActionStatus.ERROR, ActionStatus.REJECTED, ActionStatus.CANCELLED):
        return None, None
    compiled = language in COMPILED
    if compiled and _compile_failed(result):
        failed = CommandRunResult(
            status=CommandRunStatus.Finished,
            execution_time=result.exec_s,
            return_code=result.exit_code,
            stdout=result.stdout,
            stderr=result.stderr,
        )
        return failed, None
    compile_ok = CommandRunResult(status=CommandRunStatus.Finished, return_code=0, stdout="", stderr="")
    rc = result.exit_code
    if result.status is ActionStatus.TIMEOUT:
        run = CommandRunResult(
            status=CommandRunStatus.TimeLimitExceeded,
            execution_time=result.exec_s,
            return_code=rc,
            stdout=result.stdout,
            stderr=result.stderr,
        )
    else:
        if result.status is not ActionStatus.OK and not rc:
            rc = SIGKILL_RC  # a limit killed it (or it exited 0 after the limit was hit)
        run = CommandRunResult(
            status=CommandRunStatus.Finished,
            execution_time=result.exec_s,
            return_code=rc if rc is not None else 0,
            stdout=result.stdout,
            stderr=result.stderr,
        )
    return (compile_ok if compiled else None), run


def overall_status(compile_result: CommandRunResult | None, run_result: CommandRunResult | None) -> RunStatus:
    """SandboxFusion's rule: any phase Error -> SandboxError; a time limit or a non-zero
    return code -> Failed; otherwise Success. No phase at all is a SandboxError here."""
    phases = [p for p in (compile_result, run_result) if p is not None]
    if not phases or any(p.status is CommandRunStatus.Error for p in phases):
        return RunStatus.SandboxError
    if any(p.status is CommandRunStatus.TimeLimitExceeded for p in phases):
        return RunStatus.Failed
    if any(p.return_code not in (0, None) for p in phases):
        return RunStatus.Failed
    return RunStatus.Success
