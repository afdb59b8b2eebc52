"""SandboxFusion's wire models for `/run_code`, field for field (bytedance/SandboxFusion
`sandbox/server/sandbox_api.py` and the `sandbox-fusion` client package 0.3.7), plus the extra
request fields that route into Tangram's model and the extra response key `tangram` (their
pydantic models ignore keys they do not know, so their parsers accept it).

The request ignores unknown keys, as SandboxFusion's does: a client written for a newer
SandboxFusion must not be refused over a field we do not use.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from tangram_celery.common.actions import ID_PATTERN, JOB_PATTERN, MAX_CODE_BYTES


class CommandRunStatus(StrEnum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class RunStatus(StrEnum):
    Success = "Success"  # every phase finished with return code 0
    Failed = "Failed"  # a time limit, or a non-zero return code
    SandboxError = "SandboxError"  # the sandbox side failed (or refused the request)


class CommandRunResult(BaseModel):
    """One phase (compile or run) of a `/run_code` call."""

    status: CommandRunStatus
    execution_time: float | None = Field(None, description="wall-clock seconds of the phase")
    cpu_time: float | None = Field(None, description="not measured per phase by Tangram: null")
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class TangramExtras(BaseModel):
    """The request fields of `/run_code` that SandboxFusion has not (its clients never send them).

    Each is a field of `CodeAction` of the same name and meaning, and reaches it by name
    (`sandbox_fusion.to_action`): a new one is declared here and nowhere else in the HTTP layer."""

    cpus: int | str = Field(1, description="Tangram: cores, an int or an elastic range 'min..max'")
    job_id: str = Field("default", pattern=JOB_PATTERN, description="Tangram: training job")
    priority: int = Field(0, ge=-100, le=100, description="Tangram: job priority")
    image: str | None = Field(None, description="Tangram: the trajectory's container image")
    session: bool = Field(
        False, description="Tangram: bash in the trajectory's persistent shell session (cwd, variables kept)"
    )


class RunCodeRequest(TangramExtras):
    model_config = ConfigDict(extra="ignore")

    code: str = Field(max_length=MAX_CODE_BYTES, description="the code to run")
    language: str = Field(
        max_length=64,
        description="python, cpp, nodejs, go, java, rust, bash or c (GET /v1/capabilities lists what "
        "this deployment runs)",
    )
    compile_timeout: float = Field(
        10, gt=0, le=3600, description="compile time limit, s (compiled languages)"
    )
    run_timeout: float = Field(10, gt=0, le=3600, description="run time limit, s")
    memory_limit_MB: int = Field(
        -1,
        ge=-1,
        le=1 << 20,
        description="the program's memory limit, MiB (a compiler gets at least the deployment's "
        "sandbox.compile_memory_mb); -1 or 0: the sandbox default",
    )
    stdin: str | None = Field(None, max_length=16 * MAX_CODE_BYTES, description="standard input")
    files: dict[str, str | None] = Field(
        default_factory=dict, description="path -> base64 content, written before the run"
    )
    fetch_files: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="paths returned base64 in `files` after the run (relative to the workdir, or "
        "under /work or /tmp; missing files are left out)",
    )
    trajectory_id: str | None = Field(
        None,
        pattern=ID_PATTERN,
        description="Tangram: keep the sandbox (files) across calls of one trajectory; without it "
        "the call is a one-shot action",
    )


class TangramInfo(BaseModel):
    """What Tangram knows beyond SandboxFusion's enums (key `tangram` of the response)."""

    status: str = Field(
        description="Tangram's exact status (ok, failed, timeout, memory_limit, pids_limit, "
        "output_limit, disk_limit, rejected, error, cancelled) or 'overloaded' / 'deadline'"
    )
    action_id: str | None = None
    trajectory_id: str | None = None
    queue_s: float = 0.0
    exec_s: float = 0.0
    act_s: float = 0.0
    units: int = 0
    node: str = ""
    attempts: int = 0
    error: str = ""


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
    tangram: TangramInfo | None = None


class Capabilities(BaseModel):
    """What this deployment runs (GET /v1/capabilities and /tangram/v1/capabilities)."""

    languages: list[str] = Field(
        description="languages this deployment runs: those whose toolchain a CPU node's sandbox has "
        "(every language Tangram knows while no CPU worker has reported yet)"
    )
    compiled_languages: list[str] = Field(description="the languages above that have a compile phase")
    languages_reported: bool = Field(
        False, description="True once a CPU worker has reported its toolchains (languages are checked)"
    )
    languages_by_node: dict[str, list[str]] = Field(
        default_factory=dict, description="CPU node -> the languages its sandboxes run"
    )
    reward_models: list[str]
    apis: list[str]
    max_cpus: int
    max_memory_mb: int
    run_jupyter: bool = False
