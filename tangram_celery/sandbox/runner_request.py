"""What the host sends the resident runner for one action (`tangram_runner.protocol.RunRequest`)."""

from __future__ import annotations

from tangram_celery.common.actions import compile_memory_mb
from tangram_celery.sandbox.base import ExecRequest
from tangram_celery.sandbox.languages import tools_for
from tangram_celery.sandbox.limits import FETCH_MAX_BYTES, Limits
from tangram_runner.protocol import RunRequest


def runner_request(
    req: ExecRequest, limits: Limits, pythonpath: list[str], compile_floor_mb: int = 0
) -> RunRequest:
    """The request the resident runner executes for `req`: its compile phase runs under
    `compile_memory_mb` (the larger of the program's memory and `compile_floor_mb`, the sandbox
    config's `compile_memory_mb`, for a compiled language with code)."""
    rlimits = None
    if limits.use_rlimits:
        rlimits = {"AS": req.memory_mb * 1024 * 1024, "NPROC": limits.pids_limit}
    return RunRequest(
        language=req.language,
        code=req.code,
        tools=tools_for(req.language),
        memory_mb=req.memory_mb,
        compile_memory_mb=compile_memory_mb(
            req.language, req.memory_mb, compile_floor_mb, req.code is not None
        ),
        files=req.files,
        binary_files=req.binary_files,
        fetch_files=list(req.fetch_files),
        max_fetch_bytes=FETCH_MAX_BYTES,
        test_command=req.test_command,
        test_cases=[t.model_dump() for t in req.test_cases],
        stdin=req.stdin,
        timeout_s=req.timeout_s,
        compile_timeout_s=req.compile_timeout_s,
        cores=list(req.cores),
        nofile=limits.nofile,
        max_output_bytes=req.max_output_bytes or limits.max_output_bytes,
        env=dict(req.env),
        pythonpath=pythonpath,
        key=req.action_id,  # what the host's resize names (tangram_runner.control)
        verifier_group=req.verifier_group,
        rlimits=rlimits,
        session=req.session,
    )
