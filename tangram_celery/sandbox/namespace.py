"""Linux-namespace backend for machines without Docker: bubblewrap, or the built-in launcher.

Same layout as the Docker backend: fresh mount/pid/net/ipc/uts/cgroup namespaces, the host's
/usr (and /lib, /lib64, /bin, /sbin as bind mounts or the same usr-merge symlinks) read-only, a
read-only root, size- and inode-limited tmpfs at /work and /tmp, nothing else of the host (no
/etc, no /home, no worker env), and the same resident runner as PID 1. Two launchers build it
(`sandbox.namespace_launcher`): bubblewrap (`bwrap`), or `launcher.py` (`builtin`: direct
syscalls, stdlib only); `auto` takes the built-in launcher, and bubblewrap only when the built-in
one cannot build a sandbox here. (bubblewrap's child waits on an eventfd for its parent before it
arms its own parent-death signal, so a bwrap killed in that window leaves that child blocked
forever; the built-in launcher arms every hop before it waits on anything.)

Limits come from a cgroup set per sandbox (v1 or v2, created here); when no cgroup hierarchy is
writable, memory and process count fall back to RLIMIT_AS and RLIMIT_NPROC inside the runner and
cores to sched_setaffinity (weaker: RLIMIT_NPROC counts the sandbox uid host-wide, RLIMIT_AS
counts virtual memory). Needs root, like the Docker engine.

Lifetime: every hop from the worker to the runner arms a parent-death SIGKILL and then checks a
lifeline pipe only the worker holds (see `tangram_celery/common/lifeline.py`), so a sandbox cannot
outlive its worker even when the worker is killed while the sandbox starts. A restarted worker
removes the cgroups (and so the runners) of its previous incarnation before it serves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import tangram_celery.sandbox.cgroups as cgroups
from tangram_celery.common import lifeline
from tangram_celery.common.config import SandboxConfig
from tangram_celery.common.errors import SandboxError
from tangram_celery.common.pretend import pretend_missing
from tangram_celery.sandbox.cgroups import CgroupSet
from tangram_celery.sandbox.egress import Egress, sweep
from tangram_celery.sandbox.handle import Handle
from tangram_celery.sandbox.image_root import host_mounts, host_python_argv
from tangram_celery.sandbox.languages import extra_ro_paths
from tangram_celery.sandbox.launcher import PROC_COVER
from tangram_celery.sandbox.limits import (
    HOST_RO_PATHS,
    RUNNER_ARGV,
    RUNNER_DIR,
    RUNNER_SOCKET,
    SANDBOX_PYTHON,
    SANDBOX_UID,
    TOOLS_PATH,
    WORKDIR,
    Limits,
)
from tangram_celery.sandbox.pool import WarmPool
from tangram_celery.sandbox.reaper import Reaper
from tangram_celery.sandbox.stage import SandboxScope, reset_private_dir
from tangram_runner import boot

log = logging.getLogger(__name__)
RUNNER_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETUID", "CAP_SETGID")
# bwrap keeps these two for the last hop only (`launcher.py finish`: the inode limits bwrap
# cannot set, then the drop to RUNNER_CAPS); the runner never holds them
FINISH_CAPS = ("CAP_SYS_ADMIN", "CAP_SETPCAP")
BOOT_DIR = "/opt/tangram/boot"  # launcher.py + lifeline.py, read-only (bwrap only)
PROBE_TIMEOUT_S = 20.0
LAUNCHERS = ("bwrap", "builtin")
# joins the cgroups and shields itself from the OOM killer, then becomes bwrap (no preexec_fn:
# Python code between fork and exec is unsafe in a threaded worker)
_ENTER = (
    'for f in "$TG_CGROUPS"; do [ -n "$f" ] && echo $$ > "$f"; done; '
    '(echo -1000 > /proc/self/oom_score_adj) 2>/dev/null; exec "$@"'
)


def bwrap_path() -> str | None:
    """bubblewrap's path, or None (also when TANGRAM_PRETEND_MISSING names `bwrap`)."""
    return None if pretend_missing("bwrap") else shutil.which("bwrap")


def resolve_launcher(choice: str) -> str:
    """'bwrap' or 'builtin' for the configured `namespace_launcher`; raises when impossible."""
    if choice == "auto":
        if not pretend_missing("builtin"):
            return "builtin"
        if bwrap_path() is None:
            raise SandboxError(
                "bubblewrap is not installed and the built-in launcher is disabled "
                "(TANGRAM_PRETEND_MISSING=builtin): apt-get install bubblewrap"
            )
        return "bwrap"
    if choice == "bwrap" and bwrap_path() is None:
        raise SandboxError(
            "sandbox.namespace_launcher is 'bwrap' but bubblewrap is not installed: "
            "apt-get install bubblewrap, or set it to 'auto' or 'builtin'"
        )
    if choice == "builtin" and pretend_missing("builtin"):
        raise SandboxError(
            "sandbox.namespace_launcher is 'builtin' but the built-in launcher is disabled "
            "(TANGRAM_PRETEND_MISSING=builtin): set it to 'bwrap' or 'auto'"
        )
    return choice


class NamespaceSandbox(WarmPool):
    """Warm namespace sandbox per trajectory; see the module docstring."""

    name = "namespace"

    def __init__(
        self,
        cfg: SandboxConfig,
        limits: Limits | None = None,
        scope: SandboxScope | None = None,
        egress_deny: tuple[str, ...] = (),
    ) -> None:
        if os.geteuid() != 0:
            raise SandboxError(
                "the namespace backend must run as root (it creates namespaces, switches the sandbox "
                "uid and writes cgroups); run the CPU worker as root, or use sandbox.backend: docker"
            )
        self.launcher = resolve_launcher(cfg.namespace_launcher)
        self.bwrap = bwrap_path() if self.launcher == "bwrap" else None
        self.cgroup_version = cgroups.version()
        limits = limits or Limits.from_config(cfg)
        if self.cgroup_version is None:
            log.warning("no writable cgroups: memory/pids limits fall back to rlimits")
            limits = dataclasses.replace(limits, use_rlimits=True)
        # The lifeline: only this process holds the write end; every hop towards the runner
        # checks the read end after arming its parent-death signal.
        self._life_r, self._life_w = os.pipe2(os.O_CLOEXEC)
        self._exit_reaper: Reaper | None = None
        self.egress: Egress | None = None
        self._netns: dict[str, str] = {}  # state dir name -> its sandbox's network namespace
        super().__init__(cfg, limits, scope)
        try:
            if self.limits.network:  # its own namespace per sandbox, through the worker's router
                self.egress = Egress(cfg, self.who, self.stage.dir, egress_deny)
            # what PID 1's death leaves (cgroups, the stage) is removed even if we are SIGKILLed
            prefix = self.who.prefix if self.cgroup_version is not None else None
            egress = self.who if self.limits.network else None  # its router goes too
            self._exit_reaper = Reaper(
                self.stage.dir, cgroup_prefix=prefix, egress=egress, uplink=cfg.egress_uplink
            )
            try:
                self._probe()
            except SandboxError as e:
                if cfg.namespace_launcher != "auto" or self.launcher != "builtin" or bwrap_path() is None:
                    raise
                log.warning("the built-in launcher cannot run here (%s); using bubblewrap", e)
                self.launcher, self.bwrap = "bwrap", bwrap_path()
                self._probe()
        except BaseException:
            self.close()
            raise

    # -- commands ------------------------------------------------------------------------------
    def _runner_argv(self) -> list[str]:
        return [*RUNNER_ARGV, "--socket", RUNNER_SOCKET, "--uid", str(SANDBOX_UID), "--workdir", WORKDIR]

    def _finish_spec(self) -> dict[str, Any]:
        size_b = self.limits.disk_quota_mb * 1024 * 1024
        return {
            "lifeline_fd": self._life_r,
            "caps": list(RUNNER_CAPS),
            "env": {"PATH": "/usr/bin:/bin"},
            "cwd": "/",
            "remount": [[WORKDIR, size_b, self.cfg.inodes_limit], ["/tmp", size_b, self.cfg.inodes_limit]],
        }

    def command(self, state_dir: Path | None, procs_files: list[str], argv: list[str]) -> list[str]:
        """The host command that starts a sandbox running `argv` as its PID 1."""
        if self.launcher == "builtin":
            spec = self._builtin_spec(state_dir)
            spec["cgroup_procs"] = procs_files
            launch = [SANDBOX_PYTHON, "-B", "-E", "-s", "-S", str(self.stage.launcher), "run"]
            return [*launch, json.dumps(spec), "--", *argv]
        # bwrap: a shell joins the cgroups, then setpriv arms bwrap's parent-death signal before
        # bwrap runs (bwrap arms its own only after clone), and `finish` inside checks the
        # lifeline: a worker killed at any point before that leaves nothing running.
        script = _ENTER.replace('"$TG_CGROUPS"', " ".join(f"'{f}'" for f in procs_files) or "''")
        setpriv = shutil.which("setpriv")
        arm = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        netns = self._netns.get(state_dir.name) if state_dir is not None else None
        if netns is not None:  # bwrap then keeps this namespace (no --unshare-net)
            arm += ["nsenter", f"--net={netns}", "--"]
        finish = [SANDBOX_PYTHON, "-B", "-E", "-s", "-S", f"{BOOT_DIR}/launcher.py", "finish"]
        return [
            "/bin/sh",
            "-c",
            script,
            "tangram-enter",
            *arm,
            *self._bwrap_argv(state_dir),
            *finish,
            json.dumps(self._finish_spec()),
            "--",
            *argv,
        ]

    def _binds(self, state_dir: Path | None) -> list[tuple[str, str, bool]]:
        """(host source, sandbox path, read-only) after the host paths: all from the stage."""
        out = [(str(self.stage.runner), RUNNER_DIR, True)]
        out += [(p, p, True) for p in extra_ro_paths()]  # e.g. the JDK's /etc/java-17-openjdk
        if self.tools_dir is not None:
            out.append((str(self.tools_dir), TOOLS_PATH, True))
        if state_dir is not None:
            out.append((str(state_dir), str(Path(RUNNER_SOCKET).parent), False))
        if self.egress is not None:
            out.append((str(self.egress.resolv_conf), "/etc/resolv.conf", True))
        return out

    def _builtin_spec(self, state_dir: Path | None) -> dict[str, Any]:
        size_b = self.limits.disk_quota_mb * 1024 * 1024
        spec = self._finish_spec()
        spec.pop("remount")
        spec.update(
            root=str(self.stage.root),
            symlinks=[[os.readlink(p), p] for p in HOST_RO_PATHS if os.path.islink(p)],
            host_binds=[[p, p] for p in HOST_RO_PATHS if not os.path.islink(p) and os.path.isdir(p)],
            tmpfs=[[WORKDIR, size_b, self.cfg.inodes_limit], ["/tmp", size_b, self.cfg.inodes_limit]],
            dirs=["/opt/tangram", "/run"],
            binds=[list(b) for b in self._binds(state_dir)],
            netns=self._netns.get(state_dir.name) if state_dir is not None else None,
            hostname="sandbox",
        )
        return spec

    def _bwrap_argv(self, state_dir: Path | None) -> list[str]:
        assert self.bwrap is not None
        size_b = str(self.limits.disk_quota_mb * 1024 * 1024)
        # no user namespace: the runner must map the sandbox uid, which only real root can
        argv = [self.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        argv += ["--die-with-parent", "--as-pid-1", "--new-session", "--cap-drop", "ALL"]
        if state_dir is None or state_dir.name not in self._netns:
            argv.append("--unshare-net")  # a fresh one with loopback only
        for cap in (*RUNNER_CAPS, *FINISH_CAPS):
            argv += ["--cap-add", cap]
        for p in HOST_RO_PATHS:
            if os.path.islink(p):
                argv += ["--symlink", os.readlink(p), p]
            elif os.path.isdir(p):
                argv += ["--ro-bind", p, p]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        for sub in PROC_COVER:  # bwrap covers these only where root cannot write the top entry
            argv += ["--ro-bind-try", f"/proc/{sub}", f"/proc/{sub}"]
        for dest in (WORKDIR, "/tmp"):
            argv += ["--size", size_b, "--tmpfs", dest]
        argv += ["--perms", "0755", "--dir", "/opt/tangram", "--perms", "0755", "--dir", "/run"]
        for parent in sorted({os.path.dirname(p) for p in extra_ro_paths()}):  # bwrap makes them 0700
            argv += ["--perms", "0755", "--dir", parent]
        for src, dest, readonly in self._binds(state_dir):
            argv += ["--ro-bind" if readonly else "--bind", src, dest]
        argv += ["--ro-bind", str(self.stage.boot), BOOT_DIR, "--remount-ro", "/"]
        argv += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--hostname", "sandbox", "--chdir", "/"]
        return argv

    def _popen(self, argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:  # spawned from the process's one long-lived thread: PDEATHSIG fires when the
            # *thread* that forked exits, and callers' threads come and go
            proc: subprocess.Popen[bytes] = lifeline.spawn(
                subprocess.Popen,
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin"},
                pass_fds=(self._life_r,),
            )
        finally:
            os.close(fd)
        return proc

    def _probe(self) -> None:
        """Build one sandbox that runs /bin/true: fail at start, with the reason, not at the
        first action."""
        log_path = self.stage.log_path("probe")
        proc = self._popen(self.command(None, [], ["/bin/true"]), log_path)
        try:
            rc = proc.wait(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -1
        out = log_path.read_text(errors="replace").strip()[-1500:]
        log_path.unlink(missing_ok=True)
        if rc != 0:
            hint = ""
            if "not permitted" in out or "denied" in out:
                hint = (
                    "; the kernel or the container refuses namespaces or mounts (in a container: "
                    "CAP_SYS_ADMIN and no AppArmor mount rule, see compose/docker-compose.yml)"
                )
            raise SandboxError(
                f"the {self.launcher} launcher cannot build a sandbox here (exit {rc}): {out}{hint}"
            )

    # -- WarmPool hooks ----------------------------------------------------------------------------
    def _start(self, h: Handle) -> None:
        reset_private_dir(h.state_dir)
        procs_files: list[str] = []
        if self.cgroup_version is not None:
            h.cgroups = CgroupSet.create(f"{self.who.prefix}{h.state_dir.name}")
            h.cgroups.set_memory(h.memory_mb)
            h.cgroups.set_pids(self.limits.pids_limit)
            h.cgroups.bind_cores(h.cores)
            procs_files = sorted({str(d / "cgroup.procs") for d in h.cgroups.dirs.values()})
        if self.egress is not None:
            self._netns[h.state_dir.name] = self.egress.new_netns(h.state_dir.name[:12])
        if h.image is not None:
            argv = self._image_command(h, procs_files)
        else:
            argv = self.command(h.state_dir, procs_files, self._runner_argv())
        h.ref = self._popen(argv, self.stage.log_path(h.state_dir.name))

    def _image_command(self, h: Handle, procs_files: list[str]) -> list[str]:
        """The host command that starts `h`'s sandbox in its container image: the image's root
        under the trajectory's layer, the host's system directories under `HOST_DIR`, and the
        runner on the host's interpreter (`image_root`). Only the built-in launcher builds it."""
        if self.launcher != "builtin":
            raise SandboxError(
                "container images need the built-in namespace launcher (sandbox.namespace_launcher: "
                "auto or builtin); bubblewrap cannot mount a trajectory's overlay layer here"
            )
        self.images.prepare(h)
        layer, stored = h.layer, h.stored
        spec = self._builtin_spec(h.state_dir)
        size_b = self.limits.disk_quota_mb * 1024 * 1024
        links, binds = host_mounts()
        spec.update(
            overlay={
                "lower": str(stored.rootfs),
                "upper": str(layer.upper),
                "work": str(layer.work),
                "own": h.workdir if layer.fresh else "",
                "uid": SANDBOX_UID,
            },
            symlinks=[list(x) for x in links],
            host_binds=[list(x) for x in binds],
            tmpfs=[["/tmp", size_b, self.cfg.inodes_limit]],
            binds=[
                [str(self.stage.runner), RUNNER_DIR, True],
                [str(h.state_dir), str(Path(RUNNER_SOCKET).parent), False],
                *([[str(self.egress.resolv_conf), "/etc/resolv.conf", True]] if self.egress else []),
            ],
            env=self.images.runner_env(),
            cgroup_procs=procs_files,
        )
        argv = [*boot.argv(list(host_python_argv()), RUNNER_DIR, "runner"), "--socket", RUNNER_SOCKET]
        argv += ["--uid", str(SANDBOX_UID), "--workdir", h.workdir]
        launch = [SANDBOX_PYTHON, "-B", "-E", "-s", "-S", str(self.stage.launcher), "run"]
        return [*launch, json.dumps(spec), "--", *argv]

    def _alive(self, h: Handle) -> bool:
        return h.ref is not None and h.ref.poll() is None

    def _tampered(self, h: Handle) -> str:
        """After a scrub only the launcher (host pid namespace) and the runner, zygote and idle
        verifiers (one pid namespace: the sandbox's) may be in the sandbox's cgroup, and none
        may run as the sandbox uid: anything else escaped the runner's `kill(-1)`."""
        if h.cgroups is None:
            return "no cgroup to check"  # rlimit fallback: cannot see its processes from here
        host_ns = os.readlink("/proc/self/ns/pid")
        inside: set[str] = set()
        for pid in h.cgroups.procs():
            try:
                ns = os.readlink(f"/proc/{pid}/ns/pid")
                fd = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    status = os.read(fd, 1 << 16)
                finally:
                    os.close(fd)
                uids = status.split(b"\nUid:", 1)[1].split(b"\n", 1)[0].decode().split()
            except (OSError, IndexError):
                continue  # exited meanwhile
            if str(SANDBOX_UID) in uids:
                return f"pid {pid} runs as the sandbox uid"
            if ns != host_ns:
                inside.add(ns)
        if len(inside) != 1:
            return f"{len(inside)} pid namespaces in the cgroup"
        return ""

    def _logs(self, h: Handle) -> str:
        try:
            return self.stage.log_path(h.state_dir.name).read_text(errors="replace")[-2000:]
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
                log.warning("launcher of %s did not exit", h.trajectory_id)
        if h.cgroups is not None:
            h.cgroups.destroy()
            h.cgroups = None
        if self.egress is not None and self._netns.pop(h.state_dir.name, None) is not None:
            self.egress.release(h.state_dir.name[:12])
        self.stage.log_path(h.state_dir.name).unlink(missing_ok=True)

    def _sweep_previous(self) -> None:
        """Kill and remove the sandboxes of dead incarnations of this deployment and node (by
        cgroup name: `<scope>-<incarnation>-...`), never anyone else's."""
        if self.cgroup_version is not None:
            t0, n = time.monotonic(), 0
            for name in cgroups.children(f"{self.who.scope}-"):
                inc = name[len(self.who.scope) + 1 :].split("-", 1)[0]
                if not self.stage.alive(inc):
                    cg = CgroupSet.existing(name)
                    if cg is not None:
                        cg.destroy()
                        n += 1
            if n:
                log.warning(
                    "removed %d sandbox(es) left by a previous worker of this node in %.2f s",
                    n,
                    time.monotonic() - t0,
                )
        sweep(self.who.scope, self.cfg.egress_uplink, self.stage.alive)  # routers, their netns
        super()._sweep_previous()

    def close(self) -> None:
        super().close()
        if self._exit_reaper is not None:
            self._exit_reaper.close()
            self._exit_reaper = None
        if self.egress is not None:
            self.egress.close()
            self.egress = None
        for fd in (self._life_w, self._life_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self._life_w = self._life_r = -1
