"""What the host and the runner say about one action: the request the host sends and the facts
the runner answers (standard library only: both sides import this module).

The wire is one JSON object per line each way (`tangram_celery.sandbox.link`); `to_dict` and
`from_dict` are the only conversions. A request carries the protocol's version (`v`): the runner
refuses another (the host stages the runner from its own checkout, so they always match). Facts
are what the runner saw (exit code, output, flags); the host turns them into one status
(`tangram_celery.sandbox.limits.classify`). Keys a reader does not know are ignored.

The types are `NamedTuple`s (immutable: `_replace` makes a changed copy), not dataclasses:
`dataclasses` imports `inspect` and a dozen modules more, some 1.3 MiB of the runner's memory,
which the sandbox's memory limit counts; a `NamedTuple` costs nothing the runner lacks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

VERSION = 1


def _known(cls: Any, d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k in cls._fields}


class RunRequest(NamedTuple):
    """One action (or one of its two phases) for the runner (every field given: the host builds
    it, `tangram_celery.sandbox.runner_request`). Memory in MiB, times in seconds;
    `cores`: host core ids; `rlimits` only without cgroups (the RLIMIT_* fallback); `key` names
    the action for the host's resizes (`control`); `phase`: "compile" or "run" when the host
    splits an action whose compile gets more memory than its program, None for both."""

    language: str
    code: str | None
    tools: dict[str, str]  # tool -> real path (`langs`)
    memory_mb: int
    compile_memory_mb: int
    files: dict[str, str]
    binary_files: dict[str, str]  # path -> base64
    fetch_files: list[str]
    max_fetch_bytes: int
    test_command: str | None
    test_cases: list[dict[str, Any]]  # {"name", "assert_code" or "stdin"/"expected_output", ...}
    stdin: str | None
    timeout_s: float
    compile_timeout_s: float
    cores: list[int]
    nofile: int
    max_output_bytes: int
    env: dict[str, str]
    pythonpath: list[str]
    key: str
    verifier_group: str
    rlimits: dict[str, int] | None = None
    phase: str | None = None
    # the Python of the sandbox's container image, by its real path there, that runs a python
    # program and a test command's pytest (None: the runner's own: the zygote runs programs)
    interpreter: str | None = None
    # bash code run in the sandbox's persistent shell session (`session`), not a process of its own
    session: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = {"v": VERSION, **self._asdict()}
        for optional in ("rlimits", "phase", "interpreter"):
            if out[optional] is None:
                del out[optional]
        if not out["session"]:
            del out["session"]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunRequest:
        check_version(d)
        return cls(**_known(cls, d))


class Seat(NamedTuple):
    """Where the runner runs user code: the sandbox user's uid and its workdir. Not on the wire:
    the host gives them on the runner's command line (`runner.main`), fixed for its life, and
    the runner passes them beside each `RunRequest` (a request never names a uid or a path)."""

    uid: int
    workdir: str


def check_version(d: dict[str, Any]) -> None:
    """Raise ValueError unless `d` is of this protocol's version."""
    if d.get("v") != VERSION:
        raise ValueError(f"runner protocol version {d.get('v')!r}, expected {VERSION}")


class PhaseFacts(NamedTuple):
    """The compile phase: `exit_code` None when it did not end on its own; `cached`: a build of
    the same program from the same files was reused."""

    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    exec_s: float = 0.0
    timed_out: bool = False
    cached: bool = False


class TestFacts(NamedTuple):
    """One test case, or one test of a suite."""

    name: str
    passed: bool
    detail: str = ""


class SuiteFacts(NamedTuple):
    """The harness's own verdict on a `test_command` that runs pytest (`suite.verdict`)."""

    passed: bool = False
    detail: str = ""
    collected: int = 0
    deselected: int = 0


class Facts(NamedTuple):
    """What the runner saw of one action (or one phase). `runner_error`: the runner itself failed
    (the request never ran as asked); `rolled_back`: files the action wrote that were removed
    because the disk quota filled; `files`: `fetch_files`, path -> base64."""

    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    tests: tuple[TestFacts, ...] = ()
    exec_s: float = 0.0
    timed_out: bool = False
    output_capped: bool = False
    disk_full: bool = False
    killed: bool = False
    memory_error: bool = False
    fork_failed: bool = False
    compile_failed: bool = False
    setup_error: str | None = None
    compile: PhaseFacts | None = None
    suite: SuiteFacts | None = None
    rolled_back: tuple[str, ...] | None = None
    files: dict[str, str] | None = None
    runner_error: str | None = None
    # a session action's (`session`): "cwd" the shell's working directory after it, "restarted"
    # why its shell is a new one, "ended" why the shell ended during it ("": not so)
    session: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = self._asdict()
        out["tests"] = [t._asdict() for t in self.tests]
        out["compile"] = None if self.compile is None else self.compile._asdict()
        out["suite"] = None if self.suite is None else self.suite._asdict()
        out["rolled_back"] = None if self.rolled_back is None else list(self.rolled_back)
        for optional in ("suite", "rolled_back", "files", "runner_error", "session"):
            if out[optional] is None:
                del out[optional]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Facts:
        known = _known(cls, d)
        known["tests"] = tuple(TestFacts(**_known(TestFacts, t)) for t in known.get("tests") or ())
        if known.get("compile") is not None:
            known["compile"] = PhaseFacts(**_known(PhaseFacts, known["compile"]))
        if known.get("suite") is not None:
            known["suite"] = SuiteFacts(**_known(SuiteFacts, known["suite"]))
        if known.get("rolled_back") is not None:
            known["rolled_back"] = tuple(known["rolled_back"])
        return cls(**known)
