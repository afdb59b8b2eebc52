"""User-facing action and result models (pydantic), and their reduction to scheduler metadata.

An action is validated when it is built; `TangramClient.submit` refuses anything that does not
validate, so nothing invalid is ever enqueued.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_CODE_BYTES = 1 << 20  # default cap; `limits` in the config sets the deployment's own
MAX_JSON_DEPTH = 200  # hard ceiling for request/inputs nesting (serialisers recurse)
_BAD_PATH_CHARS = re.compile(r"[\x00-\x1f\x7f]")
# SandboxFusion's names for the same languages (cpp, nodejs, go, java, rust, python, bash); c is
# Tangram's own. Whether a deployment runs one depends on its CPU nodes' toolchains (see
# tangram_celery/sandbox/languages.py): clients refuse an action in a language no worker offers.
Language = Literal["python", "bash", "c", "cpp", "nodejs", "go", "java", "rust"]
LANGUAGES: tuple[str, ...] = get_args(Language)
COMPILED_LANGUAGES = frozenset({"c", "cpp", "go", "java", "rust"})  # these have a compile phase

# The shapes of an action's names, here once: the action models and their metadata on the wire
# (`wire.ActionMeta`) both use them.
_ID = r"[A-Za-z0-9_.:-]{1,128}"
ID_PATTERN = f"^{_ID}$"  # action, trajectory and test case ids
SEP = "/"  # between processes a named tenant's ids are `<tenant>/<id>` (`common.tenants`)
TRAJECTORY_PATTERN = f"^({_ID})?$"  # a trajectory id between processes: "" for none
JOB_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"  # reward models and APIs
# A container image by reference (repository[:tag][@sha256:digest]), as Docker and OCI name it:
# a name the operator's image sources resolve, never a host path.
_IMAGE_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"  # Docker's grammar: no "..", no "//"
IMAGE_PATTERN = (
    rf"^{_IMAGE_PART}(?:/{_IMAGE_PART})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?(?:@sha256:[0-9a-f]{{64}})?$"
)
Priority = Annotated[int, Field(ge=-100, le=100)]

# The context of a parse of what a client checked at submit (`stored_action`): the checks of
# user input (paths, base64, nesting depth, the fields a test or an action needs) are not run again.
STORED = {"stored": True}


def _stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("stored"))


def compile_memory_mb(language: str | None, memory_mb: int, floor_mb: int, has_code: bool = True) -> int:
    """MiB the compile phase of an action runs under: the larger of its own memory (its program's
    limit) and `floor_mb` (`sandbox.compile_memory_mb`); its memory when it compiles nothing."""
    if language in COMPILED_LANGUAGES and has_code:
        return max(memory_mb, floor_mb)
    return memory_mb


def new_id() -> str:
    return uuid.uuid4().hex


class ActionStatus(StrEnum):
    OK = "ok"  # ran; exit 0 and every test passed
    FAILED = "failed"  # the user's code exited non-zero or a test failed
    TIMEOUT = "timeout"  # wall-clock limit hit; the whole process tree was killed
    MEMORY_LIMIT = "memory_limit"
    PIDS_LIMIT = "pids_limit"  # process-count limit hit (fork bomb)
    OUTPUT_LIMIT = "output_limit"  # stdout/stderr exceeded the cap (output truncated)
    DISK_LIMIT = "disk_limit"  # workdir quota exceeded
    REJECTED = "rejected"  # refused before running (bad input, unknown model, over quota)
    ERROR = "error"  # infrastructure failure after retries were exhausted
    CANCELLED = "cancelled"  # withdrawn by its caller before it was dispatched; it never ran


class _Action(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=new_id, pattern=ID_PATTERN)
    # None: a one-shot action, part of no trajectory (see `ephemeral`; "" between processes)
    trajectory_id: str | None = Field(None, pattern=ID_PATTERN)
    # True: a code action runs in a fresh sandbox of its own, discarded when it completes,
    # not in its trajectory's (no files from earlier actions, none left for later ones); its
    # memory is reserved only while it runs and nothing needs closing. Implied without a
    # trajectory_id.
    ephemeral: bool = False
    job_id: str = Field("default", pattern=JOB_PATTERN)
    priority: Priority = 0
    timeout_s: float = Field(10.0, gt=0, le=3600)

    @property
    def one_shot(self) -> bool:
        """Runs on its own: no trajectory, or `ephemeral`."""
        return self.ephemeral or self.trajectory_id is None


class TestCase(BaseModel):
    """One test: either stdin -> expected stdout, or a Python assert snippet run after the code."""

    model_config = ConfigDict(extra="forbid")
    __test__ = False  # not a pytest class

    name: str = Field(pattern=ID_PATTERN)
    stdin: str | None = None
    expected_stdout: str | None = None
    assert_code: str | None = None

    @model_validator(mode="after")
    def _one_kind(self, info: ValidationInfo) -> TestCase:
        if not _stored(info) and (self.expected_stdout is None) == (self.assert_code is None):
            raise ValueError(f"test {self.name!r}: give expected_stdout or assert_code (one of them)")
        return self


_RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")


class CodeAction(_Action):
    """Run code (and optionally tests) in the trajectory's sandbox on CPU cores."""

    type: Literal["code"] = "code"
    language: Language = "python"
    code: str | None = None  # size capped in bytes by `limits.max_code_bytes` at submit
    files: dict[str, str] = Field(default_factory=dict)
    binary_files: dict[str, str] = Field(
        default_factory=dict, description="path -> base64 content, written as bytes before the run"
    )
    fetch_files: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="files returned base64 in the result's `files` after the run: relative to the "
        "workdir, or absolute under /work or /tmp",
    )
    test_command: str | None = Field(None, max_length=4096)
    test_cases: list[TestCase] = Field(default_factory=list, max_length=100_000)
    # the harness (runner + zygote, two resident interpreters) takes part of every sandbox's memory
    memory_mb: int = Field(512, ge=32, le=1 << 20)  # the program's; compile: `compile_memory_mb`
    cpus: int | str = Field(1, description="an int, or a range 'min..max' for elastic tests")
    stdin: str | None = None
    image: str | None = Field(
        None,
        pattern=IMAGE_PATTERN,
        max_length=400,
        description="the trajectory's container image (its task's repository and dependencies); "
        "the first action of a trajectory fixes it. None: the host-toolchain sandbox",
    )
    compile_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="limit of the compile phase (compiled languages); `timeout_s` starts after it",
    )
    session: bool = Field(
        False,
        description="bash in a trajectory only: run the code in the trajectory's persistent shell "
        "session, whose working directory, variables and functions carry over to its next session "
        "action (docs/sandbox.md, 'Shell sessions')",
    )
    fork_to: list[Annotated[str, Field(pattern=ID_PATTERN)]] = Field(
        default_factory=list,
        max_length=256,
        description="new trajectory ids that each start from a copy of this trajectory's files "
        "once this action ran (a trajectory in an image; GRPO's n samples of one prepared state)",
    )
    grade: bool = Field(
        False,
        description="judge the trajectory's files: its test_command runs in a fresh sandbox of its "
        "image holding only the trajectory's changes that are not test infrastructure, then `files` "
        "(the hidden tests); its own sandbox is left as it is (docs/sandbox.md, 'Grading a "
        "trajectory in an image')",
    )

    @field_validator("files", "binary_files")
    @classmethod
    def _paths(cls, v: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        for path in () if _stored(info) else v:
            why = file_path_error(path)
            if why is not None:
                raise ValueError(f"file path {path!r}: {why}")
        return v

    @field_validator("binary_files")
    @classmethod
    def _base64(cls, v: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        import base64
        import binascii

        for path, content in () if _stored(info) else v.items():
            try:
                base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"binary_files[{path!r}] is not valid base64") from None
        return v

    @field_validator("fetch_files")
    @classmethod
    def _fetch_paths(cls, v: list[str], info: ValidationInfo) -> list[str]:
        for path in () if _stored(info) else v:
            rel = path.removeprefix("/work/").removeprefix("/tmp/") if path.startswith("/") else path
            why = "must be relative, or absolute under /work or /tmp" if rel.startswith("/") else None
            why = why or file_path_error(rel)
            if why is not None:
                raise ValueError(f"fetch_files path {path!r}: {why}")
        return v

    @field_validator("image")
    @classmethod
    def _image_tag(cls, v: str | None) -> str | None:
        """`name` is `name:latest`, as Docker and OCI read it (one image, one spelling)."""
        if v is None or ":" in v.rsplit("/", 1)[-1] or "@" in v:
            return v
        return f"{v}:latest"

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: int | str) -> int | str:
        lo, hi = _cpu_bounds(v)
        if lo < 1 or hi < lo or hi > 256:
            raise ValueError(f"cpus {v!r}: need 1 <= min <= max <= 256")
        return v

    @model_validator(mode="after")
    def _something(self, info: ValidationInfo) -> CodeAction:
        if _stored(info):
            return self
        if self.code is None and not self.files and not self.binary_files and not self.test_command:
            raise ValueError("a code action needs code, files or a test_command")
        if self.fork_to and (self.one_shot or self.trajectory_id in self.fork_to):
            raise ValueError("fork_to needs a trajectory of its own, and new ids other than it")
        return self

    @model_validator(mode="after")
    def _session(self, info: ValidationInfo) -> CodeAction:
        if _stored(info) or not self.session:
            return self
        if self.language != "bash":
            raise ValueError(f"session needs language 'bash', not {self.language!r}")
        if self.one_shot:
            raise ValueError("session needs a trajectory_id, not ephemeral: a one-shot action has no session")
        if self.code is None or self.test_cases or self.test_command:
            raise ValueError("a session action runs code only: give tests to an action without session")
        return self

    @model_validator(mode="after")
    def _grade(self, info: ValidationInfo) -> CodeAction:
        if _stored(info) or not self.grade:
            return self
        if self.one_shot:
            raise ValueError("grade needs a trajectory_id, not ephemeral: it judges a trajectory's files")
        if not self.test_command or "pytest" not in self.test_command:
            raise ValueError("grade needs a test_command that runs pytest (the harness's verdict)")
        if self.code is not None or self.test_cases or self.session or self.fork_to:
            raise ValueError(
                "a grade action runs its files and test_command only (no code, test_cases, "
                "session or fork_to)"
            )
        return self

    @property
    def cpu_range(self) -> tuple[int, int]:
        return _cpu_bounds(self.cpus)


def file_path_error(path: str) -> str | None:
    """Why `path` cannot name a file in the workdir, or None. Only plain relative paths are
    accepted: the runner writes them as they are, and anything else (absolute, `..`, `.`, empty
    components, a trailing `/`, control characters such as NUL) is either an escape attempt or
    a mistake that would otherwise surface as an `error` inside the sandbox."""
    if not path:
        return "empty path"
    if len(path.encode()) > 1024:
        return "longer than 1024 bytes"
    if _BAD_PATH_CHARS.search(path):
        return "contains a control character (NUL, newline, ...)"
    if path.startswith("/"):
        return "must be relative to the workdir"
    if path.endswith("/"):
        return "ends with '/' (name a file, not a directory)"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return "has an empty, '.' or '..' component (write a plain relative path)"
        if len(part.encode()) > 255:
            return "has a component longer than 255 bytes"
    return None


def json_depth(value: Any) -> int:
    """Nesting depth of a JSON-like value (0 for a scalar), without recursion."""
    depth = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        elif not isinstance(v, list | tuple):
            continue
        d += 1
        depth = max(depth, d)
        if depth > MAX_JSON_DEPTH:
            return depth
        stack.extend((x, d) for x in v)
    return depth


def _shallow(name: str, v: Any) -> Any:
    if json_depth(v) > MAX_JSON_DEPTH:
        raise ValueError(f"{name} is nested deeper than {MAX_JSON_DEPTH} levels")
    return v


def _cpu_bounds(v: int | str) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    m = _RANGE.match(v)
    if m:
        return int(m.group(1)), int(m.group(2))
    if v.strip().isdigit():
        return int(v), int(v)
    raise ValueError(f"cpus {v!r} is neither an int nor a 'min..max' range")


class RewardAction(_Action):
    """Score with a reward/teacher model; `inputs` are the model's named inputs (e.g. prompt,
    response, reference)."""

    type: Literal["reward"] = "reward"
    model: str = Field(pattern=NAME_PATTERN)
    inputs: dict[str, Any]

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs_depth(cls, v: Any, info: ValidationInfo) -> Any:
        return v if _stored(info) else _shallow("inputs", v)


class ApiAction(_Action):
    """Call a rate-limited external API through its shared pool."""

    type: Literal["api"] = "api"
    api: str = Field(pattern=NAME_PATTERN)
    request: dict[str, Any] = Field(default_factory=dict)

    @field_validator("request", mode="before")
    @classmethod
    def _request_depth(cls, v: Any, info: ValidationInfo) -> Any:
        return v if _stored(info) else _shallow("request", v)


Action = Annotated[CodeAction | RewardAction | ApiAction, Field(discriminator="type")]
_ACTION: TypeAdapter[CodeAction | RewardAction | ApiAction] = TypeAdapter(Action)


def stored_action(payload: Mapping[str, Any]) -> CodeAction | RewardAction | ApiAction:
    """The action of a payload its client stored (`action.model_dump()`, checked at submit):
    typed again for the worker, without the submit's checks of user input (validated once).
    Its ids may be qualified by a tenant (`<tenant>/<id>`, `store.worker_side.own_ids`): they
    are checked as the caller's own and kept qualified."""
    ids = {k: payload[k] for k in ("id", "trajectory_id", "fork_to") if payload.get(k)}
    if not any(SEP in str(v) for v in ids.values()):
        return _ACTION.validate_python(payload, context=STORED)
    local = {
        k: [str(t).rpartition(SEP)[2] for t in v] if k == "fork_to" else str(v).rpartition(SEP)[2]
        for k, v in ids.items()
    }
    return _ACTION.validate_python({**payload, **local}, context=STORED).model_copy(update=ids)


class TestOutcome(BaseModel):
    __test__ = False
    name: str
    passed: bool
    detail: str = ""


class PhaseOutcome(BaseModel):
    """One phase of a code action before its run (compiling), reported beside the run.
    `exit_code` is None when the phase did not end on its own (time limit, output cap).
    `cached`: the trajectory's sandbox had built the same program from the same files before,
    and that build was used."""

    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    exec_s: float = 0.0
    timed_out: bool = False
    cached: bool = False
