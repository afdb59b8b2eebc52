"""Docker backend: one container per trajectory, through the Docker SDK.

The image is empty (`docker import` of an empty tar, made on first use); the host's /usr, /lib,
/lib64, /bin are bind-mounted read-only, so sandboxes run the host's python3, bash and gcc.
The container's PID 1 is the resident runner, reached over a unix socket in a bind-mounted host
directory; the engine must therefore be local (the worker binds host core ids anyway).
Cores are bound by writing the container's cgroups directly when the host can (sub-ms), else by
`docker update` (~20 ms).

Containers are named from a hash of the trajectory id (any two ids get two containers; the
readable id is a label) and labelled with the worker's scope and incarnation. Containers are
not the worker's children, so a reaper process (`reaper.py`, in its own session) removes this
incarnation's containers when the worker dies, however it dies; a restarted worker also removes
what a previous incarnation of the same deployment and node left.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import select
import shutil
import tarfile
import threading
from pathlib import Path
from typing import Any

from tangram_celery.common.config import SandboxConfig
from tangram_celery.common.errors import SandboxError
from tangram_celery.common.pretend import pretend_missing
from tangram_celery.sandbox.cgroups import CPU_PERIOD_US, CgroupSet
from tangram_celery.sandbox.docker_images import DockerImages, host_volumes
from tangram_celery.sandbox.egress import Egress, sweep
from tangram_celery.sandbox.handle import Handle
from tangram_celery.sandbox.image_layers import ImageLayers
from tangram_celery.sandbox.image_root import host_python_argv
from tangram_celery.sandbox.languages import extra_ro_paths
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
from tangram_celery.sandbox.pool import WarmPool
from tangram_celery.sandbox.reaper import Reaper
from tangram_celery.sandbox.stage import SandboxScope, reset_private_dir
from tangram_runner import boot

log = logging.getLogger(__name__)
# root inside the container only needs to own files and signal/setuid to the sandbox uid
RUNNER_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETUID", "SETGID"]
LABEL = "tangram.sandbox"  # the worker incarnation that owns the container
SCOPE_LABEL = "tangram.scope"  # its deployment and node
TRAJECTORY_LABEL = "tangram.trajectory"


def container_name(who: SandboxScope, trajectory_id: str) -> str:
    """A name that no other trajectory id maps to (a hash), unique per worker incarnation."""
    digest = hashlib.sha256(trajectory_id.encode()).hexdigest()[:24]
    return f"tangram-{who.prefix}{digest}"


def connect(base_url: str | None, timeout_s: float = 30.0) -> Any:
    """A DockerClient for `base_url` (None: DOCKER_HOST or the default socket), pinged."""
    try:
        import docker
    except ImportError as e:  # pragma: no cover - docker is a core dependency
        raise SandboxError("the docker backend needs the docker package: pip install docker") from e
    if pretend_missing("docker"):
        raise SandboxError("no Docker engine (TANGRAM_PRETEND_MISSING=docker)")
    try:
        client = (
            docker.DockerClient(base_url=base_url, timeout=int(timeout_s))
            if base_url
            else docker.from_env(timeout=int(timeout_s))
        )
        client.ping()
    except Exception as e:
        raise SandboxError(f"no Docker engine at {base_url or os.environ.get('DOCKER_HOST')}: {e}") from None
    return client


def ensure_image(client: Any, name: str) -> None:
    """Import an empty image called `name` unless it exists (there is no registry)."""
    import docker

    try:
        client.images.get(name)
        return
    except docker.errors.ImageNotFound:
        pass
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w"):
        pass
    repo, _, tag = name.partition(":")
    client.api.import_image_from_data(buf.getvalue(), repository=repo, tag=tag or "latest")
    log.info("imported empty image %s", name)


class DockerSandbox(WarmPool):
    """Warm container per trajectory; see the module docstring."""

    name = "docker"

    def __init__(
        self,
        cfg: SandboxConfig,
        limits: Limits | None = None,
        scope: SandboxScope | None = None,
        egress_deny: tuple[str, ...] = (),
    ) -> None:
        self.client = connect(cfg.docker_host)
        self.egress: Egress | None = None
        ensure_image(self.client, cfg.image)
        self._exit_reaper: Reaper | None = None
        # container id -> a pidfd of its runner (`_alive` without a /proc read or an API call)
        self._pidfds: dict[str, int] = {}
        self._pidfd_lock = threading.Lock()
        super().__init__(cfg, limits, scope)
        self.images: Any = DockerImages(self.client, self.who.prefix.rstrip("-") or "w", cfg.image)
        self._start_reaper()
        if self.limits.network:  # containers start with no network; `_network` links each one
            self.egress = Egress(cfg, self.who, self.stage.dir, egress_deny)

    def _start_reaper(self) -> None:
        """Containers are not our children: a reaper removes this incarnation's once we are gone."""
        url = self.cfg.docker_host or os.environ.get("DOCKER_HOST") or ""
        labels = (f"{LABEL}={self.who.incarnation}", f"{SCOPE_LABEL}={self.who.scope}")
        egress = self.who if self.limits.network else None  # its router goes too
        self._exit_reaper = Reaper(
            self.stage.dir, docker_url=url, labels=labels, egress=egress, uplink=self.cfg.egress_uplink
        )

    def _sweep_previous(self) -> None:
        """Remove containers of dead incarnations of this deployment and node, never others'."""
        try:
            found = self.client.containers.list(  # one removed meanwhile is not an error
                all=True, ignore_removed=True, filters={"label": f"{SCOPE_LABEL}={self.who.scope}"}
            )
        except Exception as e:
            log.warning("cannot list containers to sweep: %s", e)
            found = []
        n = 0
        for c in found:
            inc = c.labels.get(LABEL, "")
            if inc != self.who.incarnation and not self.stage.alive(inc):
                try:
                    c.remove(force=True)
                    n += 1
                except Exception as e:
                    log.warning("cannot remove leftover container %s: %s", c.name, e)
        if n:
            log.warning("removed %d container(s) left by a previous worker of this node", n)
        sweep(self.who.scope, self.cfg.egress_uplink, self.stage.alive)  # their routers (egress.py)
        super()._sweep_previous()

    def _start(self, h: Handle) -> None:
        if h.image is not None and self._restart_kept(h):
            return
        reset_private_dir(h.state_dir)
        quota = f"rw,exec,nosuid,nodev,size={self.limits.disk_quota_mb}m,nr_inodes={self.cfg.inodes_limit}"
        volumes = {
            p: {"bind": p, "mode": "ro"} for p in (*HOST_RO_PATHS, *extra_ro_paths()) if os.path.exists(p)
        }
        volumes[str(self.stage.runner)] = {"bind": RUNNER_DIR, "mode": "ro"}
        volumes[str(h.state_dir)] = {"bind": str(Path(RUNNER_SOCKET).parent), "mode": "rw"}
        if self.tools_dir is not None:
            volumes[str(self.tools_dir)] = {"bind": TOOLS_PATH, "mode": "ro"}
        image, workdir, env = self.cfg.image, WORKDIR, {}
        python: list[str] | tuple[str, ...] = RUNNER_ARGV[:1]
        tmpfs = {WORKDIR: quota, "/tmp": quota}
        if h.image is not None:  # the trajectory's image: the host's system under HOST_DIR
            self.images.prepare(h)
            image, workdir, python = self.images.start_image(h), h.workdir, host_python_argv()
            volumes = {
                k: v for k, v in volumes.items() if v["bind"] in (RUNNER_DIR, str(Path(RUNNER_SOCKET).parent))
            }
            volumes.update(host_volumes())
            env, tmpfs = ImageLayers.runner_env(), {"/tmp": quota}
        if self.egress is not None:
            volumes[str(self.egress.resolv_conf)] = {"bind": "/etc/resolv.conf", "mode": "ro"}
        cmd = [*boot.argv(list(python), RUNNER_DIR, "runner"), "--socket", RUNNER_SOCKET]
        cmd += ["--uid", str(SANDBOX_UID), "--workdir", workdir]
        if h.image is not None and not h.kept_files:
            cmd += ["--own", "1"]  # the image's workdir becomes the sandbox user's
        try:
            h.ref = self.client.containers.run(
                image,
                cmd[1:],
                entrypoint=cmd[:1],  # never the image's own entrypoint or user
                user="0:0",
                detach=True,
                name=container_name(self.who, h.trajectory_id),
                labels={
                    LABEL: self.who.incarnation,
                    SCOPE_LABEL: self.who.scope,
                    TRAJECTORY_LABEL: h.trajectory_id[:1000],
                },
                network_mode="none",  # with sandbox.network, its own namespace gets a link
                read_only=h.image is None,  # an image's root is the trajectory's layer
                tmpfs=tmpfs,
                volumes=volumes,
                cap_drop=["ALL"],
                cap_add=RUNNER_CAPS,
                security_opt=["no-new-privileges"],
                mem_limit=f"{h.memory_mb}m",
                memswap_limit=f"{h.memory_mb}m",
                pids_limit=self.limits.pids_limit,
                cpuset_cpus=",".join(map(str, h.cores)),
                cpu_period=CPU_PERIOD_US,
                cpu_quota=CPU_PERIOD_US * len(h.cores),
                hostname="sandbox",
                environment=env,
                working_dir="/",
            )
            h.ref.reload()
        except Exception as e:
            raise SandboxError(f"cannot start sandbox container: {e}") from None
        self._adopt_pid(h)
        self._network(h)

    def _network(self, h: Handle) -> None:
        """With sandbox.network: link the container's own network namespace to the router."""
        if self.egress is None:
            return
        pid = int(h.ref.attrs["State"]["Pid"])
        self.egress.attach(h.state_dir.name, str(pid), f"/proc/{pid}/ns/net")

    def _restart_kept(self, h: Handle) -> bool:
        """Start the trajectory's kept (stopped) container again, if it has one here: its files
        are intact (`docker_images`)."""
        self.images.prepare(h)
        kept = self.images.kept_container(h.trajectory_id)
        if kept is None:
            return False
        container, state_dir = kept
        if state_dir != h.state_dir:  # the container binds its first state directory
            shutil.rmtree(h.state_dir, ignore_errors=True)
            h.state_dir = state_dir
        h.state_dir.mkdir(mode=0o700, exist_ok=True)  # removed with the handle that left it
        reset_private_dir(h.state_dir)
        try:
            container.start()
            container.reload()
        except Exception as e:
            with contextlib.suppress(Exception):
                container.remove(force=True)
            self.images.dropped[h.trajectory_id] = f"its kept container did not start again: {e}"
            return False
        h.ref, h.kept_files = container, True
        self._adopt_pid(h)
        self._network(h)
        return True

    def _adopt_pid(self, h: Handle) -> None:
        """The runner's host pid: shielded from the OOM killer, its cgroups read directly, a
        pidfd of it kept (liveness by a poll, never fooled by a reused pid)."""
        pid = int(h.ref.attrs["State"]["Pid"])
        try:
            fd: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError) as e:  # an old kernel: `_alive` reads /proc instead
            log.debug("no pidfd for the runner: %s", e)
            fd = None
        with self._pidfd_lock:
            old = self._pidfds.pop(h.ref.id, None)
            if fd is not None:
                self._pidfds[h.ref.id] = fd
        if old is not None:
            os.close(old)
        try:  # user code raises its own score to 1000 anyway; lowering needs CAP_SYS_RESOURCE
            Path(f"/proc/{pid}/oom_score_adj").write_text("-1000")
        except OSError as e:
            log.debug("cannot lower the runner's OOM score: %s", e)
        h.cgroups = CgroupSet.of_pid(pid)

    def _bind(self, h: Handle, cores: tuple[int, ...], memory_mb: int) -> None:
        if h.cgroups is not None:
            try:
                super()._bind(h, cores, memory_mb)
                return
            except OSError as e:
                log.info("direct cgroup write failed (%s); using docker update", e)
        if cores != h.cores or memory_mb != h.memory_mb:
            h.ref.update(
                cpuset_cpus=",".join(map(str, cores)),
                cpu_period=CPU_PERIOD_US,
                cpu_quota=CPU_PERIOD_US * len(cores),
                mem_limit=f"{memory_mb}m",
                memswap_limit=f"{memory_mb}m",
            )

    def _alive(self, h: Handle) -> bool:
        """Cheap when the engine is local: has the runner's pidfd not become readable (the
        process exited), or else is its host pid still a live process."""
        with self._pidfd_lock:  # not closed meanwhile (`_drop_pidfd`)
            fd = self._pidfds.get(h.ref.id)
            if fd is not None:
                return not select.select([fd], [], [], 0)[0]
        pid = int(h.ref.attrs["State"]["Pid"] or 0)
        if pid > 0:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return False
            return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        try:
            h.ref.reload()
        except Exception:
            return False
        return bool(h.ref.attrs["State"]["Running"])

    def _logs(self, h: Handle) -> str:
        try:
            return str(h.ref.logs(tail=20).decode(errors="replace"))
        except Exception:
            return ""

    def _drop_pidfd(self, container_id: str) -> None:
        with self._pidfd_lock:
            fd = self._pidfds.pop(container_id, None)
        if fd is not None:
            os.close(fd)

    def _destroy(self, h: Handle) -> None:
        if h.ref is None:
            return
        self._drop_pidfd(h.ref.id)  # its runner goes (a kept container gets a new one)
        if self.egress is not None:
            self.egress.release(h.state_dir.name)
        if h.image is not None and self.images.retire(h):
            return  # stopped and kept for the trajectory's next action
        try:
            h.ref.remove(force=True)
        except Exception as e:
            log.debug("remove container of %s: %s", h.trajectory_id, e)

    def _release_image(self, h: Handle) -> None:
        """Nothing more: `_destroy` kept or removed the container."""

    def close(self) -> None:
        super().close()
        self.images.close()
        try:  # anything of ours a crashed action may have left behind
            for c in self.client.containers.list(
                all=True, ignore_removed=True, filters={"label": f"{LABEL}={self.owner}"}
            ):
                c.remove(force=True)
        except Exception as e:
            log.debug("final sweep: %s", e)
        self.client.close()
        for cid in list(self._pidfds):
            self._drop_pidfd(cid)
        if self.egress is not None:
            self.egress.close()
        if self._exit_reaper is not None:
            self._exit_reaper.close()  # finds nothing left and exits
