"""The sandbox's runner without the sandbox, for benchmarks: the fair baseline for what isolation
costs per test.

The same runner code (`tangram_runner/`: warm zygote, fork server, the harness's
own verdict, build cache) runs as PID 1 of a bare pid + mount namespace, which it needs to run at
all: it chowns /tmp and its workdir (here private tmpfs mounts, not the host's) and may
`kill(-1)` (only its own processes here). Nothing else of the sandbox: no cgroups (no memory,
pids or cpuset accounting; the process is pinned with `taskset`), the host's root file system
read-write and its /etc, no network, IPC or UTS namespace, no read-only root. The seccomp filter
stays: the zygote installs it on itself as part of the runner.

Root only (namespaces, uid switching), like the namespace backend.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tangram_celery.sandbox import ExecRequest, ExecResult
from tangram_celery.sandbox.limits import (
    SANDBOX_PYTHON,
    SANDBOX_UID,
    Limits,
    runner_timeout_s,
    to_result,
)
from tangram_celery.sandbox.link import call_runner
from tangram_celery.sandbox.runner_request import runner_request
from tangram_celery.sandbox.stage import RUNNER_SRC_DIR
from tangram_runner import boot
from tangram_runner.protocol import Facts

TMPFS_MB = 64  # /tmp and the workdir, as the sandbox's default quota


class BareRunner:
    """One unsandboxed runner pinned to `core` (a fresh one has an empty build cache)."""

    def __init__(self, core: int, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.dir = Path(tempfile.mkdtemp(prefix="tangram-bare-", dir="/run"))
        os.chmod(self.dir, 0o700)
        runner = self.dir / "runner"
        shutil.copytree(
            RUNNER_SRC_DIR, runner / "tangram_runner", ignore=shutil.ignore_patterns("__pycache__")
        )
        for p in [runner, *runner.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(self.dir, 0o711)  # the sandbox uid must reach the runner's files, not list them
        self.sock = self.dir / "sock" / "runner.sock"
        self.sock.parent.mkdir(mode=0o700)
        work = self.dir / "work"
        work.mkdir()
        opts = f"size={TMPFS_MB}m,nosuid,nodev"
        script = (
            f"mount -t tmpfs -o {opts} tmpfs /tmp && mount -t tmpfs -o {opts} tmpfs {work} && "
            f"exec taskset -c {core} {shlex.join(boot.argv(SANDBOX_PYTHON, str(runner), 'runner'))} "
            f"--socket {self.sock} --uid {SANDBOX_UID} --workdir {work}"
        )
        argv = [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount",
            "--mount-proc",
            "--propagation",
            "private",
        ]
        self.proc = subprocess.Popen([*argv, "sh", "-c", script], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the bare runner did not start")
            time.sleep(0.01)

    def run(self, req: ExecRequest) -> ExecResult:
        payload = runner_request(req, self.limits, []).to_dict()
        facts = Facts.from_dict(call_runner(self.sock, payload, runner_timeout_s(req)))
        if facts.runner_error is not None:
            raise RuntimeError(facts.runner_error)
        return to_result(facts, {}, req)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # unshare --fork: its child, the namespace's PID 1, goes with it
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
