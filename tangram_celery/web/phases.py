"""Compile and run phases: a SandboxFusion call's time limits into a CodeAction, and a Tangram
result back into SandboxFusion's compile_result / run_result and overall status.

The runner times the phases apart: `compile_timeout` becomes the compile phase's own limit
(`CodeAction.compile_timeout_s`) and `run_timeout` the run's; the compile phase's outcome comes
back as `ActionResult.compile`.
"""

from __future__ import annotations

from typing import Any

from tangram_celery.common.actions import COMPILED_LANGUAGES, LANGUAGES, ActionStatus, PhaseOutcome
from tangram_celery.common.wire import ActionResult
from tangram_celery.web.sandbox_models import CommandRunResult, CommandRunStatus, RunStatus

COMPILED = COMPILED_LANGUAGES
SIGKILL_RC = -9  # how SandboxFusion reports a process killed by a signal (OOM, limits)


def phase_limits(language: str, compile_timeout_s: float, run_timeout_s: float) -> dict[str, Any]:
    """CodeAction fields for a call's compile and run time limits (each phase its own)."""
    if language in COMPILED:
        return {"timeout_s": run_timeout_s, "compile_timeout_s": compile_timeout_s}
    return {"timeout_s": run_timeout_s}


def action_budget_s(language: str, compile_timeout_s: float, run_timeout_s: float) -> float:
    """The longest an action may run once started (the deadline logic keeps this much room)."""
    return compile_timeout_s + run_timeout_s if language in COMPILED else run_timeout_s


def _compile_result(phase: PhaseOutcome) -> tuple[CommandRunResult, bool]:
    """SandboxFusion's compile_result of a compile phase, and whether the compile failed."""
    if phase.timed_out:
        status, rc = CommandRunStatus.TimeLimitExceeded, None
    else:  # no exit code: the phase was ended (output cap, OOM kill)
        status, rc = (
            CommandRunStatus.Finished,
            (phase.exit_code if phase.exit_code is not None else SIGKILL_RC),
        )
    out = CommandRunResult(
        status=status, execution_time=phase.exec_s, return_code=rc, stdout=phase.stdout, stderr=phase.stderr
    )
    return out, phase.timed_out or rc != 0


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
    compile_result: CommandRunResult | None = None
    run_s = result.exec_s
    if result.compile is not None:
        compile_result, failed = _compile_result(result.compile)
        if failed:
            return compile_result, None
        run_s = max(0.0, result.exec_s - result.compile.exec_s)
    elif language in COMPILED:  # a result from before phases were reported
        compile_result = CommandRunResult(
            status=CommandRunStatus.Finished, return_code=0, stdout="", stderr=""
        )
    rc = result.exit_code
    if result.status is ActionStatus.TIMEOUT:
        run = CommandRunResult(
            status=CommandRunStatus.TimeLimitExceeded,
            execution_time=run_s,
            return_code=rc,
            stdout=result.stdout,
            stderr=result.stderr,
        )
    else:
        if result.status is not ActionStatus.OK and not rc:
            rc = SIGKILL_RC  # a limit killed it (or it exited 0 after the limit was hit)
        run = CommandRunResult(
            status=CommandRunStatus.Finished,
            execution_time=run_s,
            return_code=rc if rc is not None else 0,
            stdout=result.stdout,
            stderr=result.stderr,
        )
    return compile_result, run


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


__all__ = ["COMPILED", "LANGUAGES", "action_budget_s", "overall_status", "phase_limits", "split_phases"]
