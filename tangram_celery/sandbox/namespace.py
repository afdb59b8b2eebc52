"""Linux-namespace backend (bubblewrap) for machines without Docker.

Same layout as the Docker backend: fresh mount/pid/net/ipc/uts namespaces, the host's /usr (and
/lib, /lib64, /bin as bind mounts or the same usr-merge symlinks) read-only, size-limited tmpfs
at /work and /tmp, nothing else of the host (no /etc, no /home, no worker env), and the same
resident runner as PID 1. Limits come from a cgroup set per trajectory (v1 or v2, created here);
when no cgroup hierarchy is writable, memory and process count fall back to RLIMIT_AS and
RLIMIT_NPROC inside the runner and cores to sched_setaffinity (weaker: RLIMIT_NPROC counts the
sandbox uid host-wide, RLIMIT_AS counts virtual memory). Needs root, like the Docker engine.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tangram_celery.config import SandboxConfig
from tangram_celery.errors import SandboxError
from tangram_celery.sandbox import cgroups
from tangram_celery.sandbox.cgroups import CgroupSet
from tangram_celery.sandbox.limits import (
    HOST_RO_PATHS,
    RUNNER_ARGV,
    RUNNER_DIR,
    RUNNER_SOCKET,
    SANDBOX_UID,
    TOOLS_PATH,
    WORKDIR,
    Limits,
)
from tangram_celery.sandbox.pool import Handle, WarmPool

log = logging.getLogger(__name__)
RUNNER_SRC_DIR = Path(__file__).with_name("inside")
RUNNER_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETUID", "CAP_SETGID")
# joins the cgroups and shields itself from the OOM killer, then becomes bwrap (no preexec_fn:
# Python code between fork and exec is unsafe in a threaded worker)
_ENTER = (
    'for f in "$TG_CGROUPS"; do [ -n "$f" ] && echo $$ > "$f"; done; '
    '(echo -1000 > /proc/self/oom_score_adj) 2>/dev/null; exec "$@"'
)


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


class NamespaceSandbox(WarmPool):
    """Warm bubblewrap namespace per trajectory; see the module docstring."""

    name = "namespace"

    def __init__(self, cfg: SandboxConfig, limits: Limits | None = None) -> None:
        bwrap = bwrap_path()
        if bwrap is None:
            raise SandboxError("the namespace backend needs bubblewrap: apt-get install bubblewrap")
        if os.geteuid() != 0:
            raise SandboxError(
                "the namespace backend must run as root (it switches the sandbox "
                "uid and writes cgroups); use the docker backend otherwise"
            )
        self.bwrap = bwrap
        self.cgroup_version = cgroups.version()
        limits = limits or Limits.from_config(cfg)
        if self.cgroup_version is None:
            log.warning("no writable cgroups: memory/pids limits fall back to rlimits")
            limits = dataclasses.replace(limits, use_rlimits=True)
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="bwrap-spawner")
        super().__init__(cfg, limits)

    def _argv(self, h: Handle) -> list[str]:
        size_b = str(self.limits.disk_quota_mb * 1024 * 1024)
        # no user namespace: the runner must map the sandbox uid, which only real root can
        argv = [
            self.bwrap,
            "--unshare-ipc",
            "--unshare-pid",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--as-pid-1",
            "--new-session",
            "--cap-drop",
            "ALL",
        ]
        if not self.limits.network:
            argv.append("--unshare-net")
        for cap in RUNNER_CAPS:
            argv += ["--cap-add", cap]
        for p in HOST_RO_PATHS:
            if os.path.islink(p):
                argv += ["--symlink", os.readlink(p), p]
            elif os.path.isdir(p):
                argv += ["--ro-bind", p, p]
        argv += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            size_b,
            "--tmpfs",
            WORKDIR,
            "--size",
            size_b,
            "--tmpfs",
            "/tmp",
            "--perms",
            "0755",
            "--dir",
            "/opt",
            "--perms",
            "0755",
            "--dir",
            str(Path(RUNNER_DIR).parent),
            "--bind",
            str(h.state_dir),
            str(Path(RUNNER_SOCKET).parent),
            "--ro-bind",
            str(RUNNER_SRC_DIR),
            RUNNER_DIR,
        ]
        if self.tools_dir is not None:
            argv += ["--ro-bind", str(self.tools_dir), TOOLS_PATH]
        argv += [
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--hostname",
            "sandbox",
            "--chdir",
            "/",
            *RUNNER_ARGV,
            "--socket",
            RUNNER_SOCKET,
            "--uid",
            str(SANDBOX_UID),
            "--workdir",
            WORKDIR,
        ]
        return argv

    def _start(self, h: Handle) -> None:
        procs_files: list[str] = []
        if self.cgroup_version is not None:
            h.cgroups = CgroupSet.create(f"{self.owner}-{h.state_dir.name}")
            h.cgroups.set_memory(h.memory_mb)
            h.cgroups.set_pids(self.limits.pids_limit)
            h.cgroups.bind_cores(h.cores)
            procs_files = sorted({str(d / "cgroup.procs") for d in h.cgroups.dirs.values()})
        log_file = open(h.state_dir / "bwrap.log", "wb")  # noqa: SIM115
        script = _ENTER.replace('"$TG_CGROUPS"', " ".join(f"'{f}'" for f in procs_files) or "''")
        argv = ["/bin/sh", "-c", script, "tangram-enter", *self._argv(h)]
        try:  # spawned from one long-lived thread: --die-with-parent fires when the *thread*
            # that forked bwrap exits, and callers' threads come and go
            h.ref = self._spawner.submit(
                subprocess.Popen,
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin"},
            ).result()
        finally:
            log_file.close()

    def _alive(self, h: Handle) -> bool:
        return h.ref is not None and h.ref.poll() is None

    def _logs(self, h: Handle) -> str:
        try:
            return (h.state_dir / "bwrap.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _destroy(self, h: Handle) -> None:
        if h.ref is not None:
            try:
                os.killpg(h.ref.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                h.ref.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("bwrap of %s did not exit", h.trajectory_id)
        if h.cgroups is not None:
            h.cgroups.destroy()
            h.cgroups = None

    def close(self) -> None:
        super().close()
        self._spawner.shutdown(wait=False)
