"""Hard limits and the one place where facts become a status, shared by every backend.

The runner reports facts (exit code, timed out, output capped, disk full, error strings seen);
the host adds the cgroup counters it read before and after the exec (OOM kills, forks refused at
the pids limit). `classify` maps both to exactly one `ActionStatus`, the same way on every backend.
"""

from __future__ import annotations

from dataclasses import dataclass

from tangram_celery.common.actions import (
    COMPILED_LANGUAGES,
    ActionStatus,
    PhaseOutcome,
    TestOutcome,
)
from tangram_celery.common.config import SandboxConfig
from tangram_celery.sandbox.base import ExecRequest, ExecResult
from tangram_runner import boot
from tangram_runner.protocol import Facts

SANDBOX_PYTHON = "/usr/bin/python3"
SANDBOX_UID = 10001  # the uid user code runs as; owns nothing outside the workdir and /tmp
VERIFIER_UID = SANDBOX_UID + 1  # assert tests are judged under this uid (the runner derives it)
WORKDIR = "/work"
RUNNER_SOCKET = "/run/tangram/runner.sock"
RUNNER_DIR = "/opt/tangram/runner"  # holds the package tangram_runner, read-only
RUNNER_ARGV = boot.argv(SANDBOX_PYTHON, RUNNER_DIR, "runner")  # -E -s -S, RUNNER_DIR first on sys.path
TOOLS_PATH = "/opt/tangram/site"  # read-only site-packages with pytest + pytest-xdist
HOST_RO_PATHS = ("/usr", "/lib", "/lib64", "/bin", "/sbin")
RUNNER_GRACE_S = 5.0  # the host gives up on a runner this long after the action's timeout
FETCH_MAX_BYTES = 16 << 20  # fetch_files returned per action, in all (files beyond are left out)


@dataclass(frozen=True)
class Limits:
    """Per-sandbox hard limits (from SandboxConfig); memory comes from each request."""

    pids_limit: int = 128
    max_output_bytes: int = 65536
    disk_quota_mb: int = 64
    network: bool = False
    use_rlimits: bool = False  # no cgroups: fall back to RLIMIT_AS / RLIMIT_NPROC
    nofile: int = 1024  # RLIMIT_NOFILE of every user process

    @classmethod
    def from_config(cls, cfg: SandboxConfig) -> Limits:
        return cls(
            cfg.pids_limit, cfg.max_output_bytes, cfg.disk_quota_mb, cfg.network, nofile=cfg.nofile_limit
        )


def runner_timeout_s(req: ExecRequest) -> float:
    """How long the host waits for the runner's answer: both phases' limits plus a grace."""
    compiled = req.language in COMPILED_LANGUAGES and req.code is not None
    compile_s = req.compile_timeout_s if compiled else 0.0
    return req.timeout_s + compile_s + RUNNER_GRACE_S


def classify(facts: Facts, delta: dict[str, int], has_tests: bool) -> ActionStatus:
    """One status per action. A limit outranks the failure it caused (a fork bomb usually also
    times out; a memory bomb also exits non-zero). A test command that mentions pytest passes
    only on the harness's own verdict (`suite`), whatever its exit status."""
    if delta.get("pids_max", 0) > 0 or (facts.fork_failed and not delta):
        return ActionStatus.PIDS_LIMIT
    if delta.get("oom_kill", 0) > 0 or (facts.memory_error and not facts.timed_out):
        return ActionStatus.MEMORY_LIMIT
    if facts.disk_full:
        return ActionStatus.DISK_LIMIT
    if facts.output_capped:
        return ActionStatus.OUTPUT_LIMIT
    if facts.timed_out:
        return ActionStatus.TIMEOUT
    if facts.killed and not delta:
        return ActionStatus.MEMORY_LIMIT  # no counters to ask: an unexplained SIGKILL is the OOM
    if facts.compile_failed or facts.setup_error or facts.exit_code not in (0, None):
        return ActionStatus.FAILED
    suite = facts.suite
    if suite is not None and not suite.passed:
        return ActionStatus.FAILED
    if (has_tests or suite is not None) and not all(t.passed for t in facts.tests):
        return ActionStatus.FAILED
    return ActionStatus.OK


def to_result(facts: Facts, delta: dict[str, int], req: ExecRequest) -> ExecResult:
    has_tests = bool(req.test_cases)
    status = classify(facts, delta, has_tests)
    details = [_rolled_back_detail(facts.rolled_back)]
    suite = facts.suite
    if suite is not None and not suite.passed:
        details.append(f"test suite not passed: {suite.detail}")
    if suite is not None and suite.deselected:
        details.append(f"{suite.deselected} test(s) deselected")
    if facts.setup_error:
        details.append(str(facts.setup_error))
    for key, what in (("restarted", "session restarted"), ("ended", "session ended")):
        if facts.session and facts.session.get(key):  # `tangram_runner.session`
            details.append(f"{what}: {facts.session[key]}")
    return ExecResult(
        status=status,
        exit_code=facts.exit_code,
        stdout=facts.stdout,
        stderr=facts.stderr,
        tests=[TestOutcome(**t._asdict()) for t in facts.tests],
        exec_s=float(facts.exec_s),
        detail="; ".join(d for d in details if d),
        compile=PhaseOutcome(**facts.compile._asdict()) if facts.compile is not None else None,
        files=dict(facts.files or {}),
        cpu_s=delta["cpu_us"] / 1e6 if "cpu_us" in delta else None,
    )


def _rolled_back_detail(paths: tuple[str, ...] | None) -> str:
    if not paths:
        return ""
    shown = ", ".join(paths[:10]) + (f" and {len(paths) - 10} more" if len(paths) > 10 else "")
    return f"disk quota filled: removed {len(paths)} file(s) the action wrote: {shown}"


def counter_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int]:
    """after - before per counter; {} when the backend could not read counters."""
    if before is None or after is None:
        return {}
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}
