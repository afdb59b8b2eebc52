"""Docker backend: one container per trajectory, through the Docker SDK.

The image is empty (`docker import` of an empty tar, made on first use); the host's /usr, /lib,
/lib64, /bin are bind-mounted read-only, so sandboxes run the host's python3, bash and gcc.
The container's PID 1 is the resident runner, reached over a unix socket in a bind-mounted host
directory; the engine must therefore be local (the worker binds host core ids anyway).
Cores are bound by writing the container's cgroups directly when the host can (sub-ms), else by
`docker update` (~20 ms).
"""

from __future__ import annotations

import io
import logging
import os
import re
import tarfile
from pathlib import Path
from typing import Any

from tangram_celery.config import SandboxConfig
from tangram_celery.errors import SandboxError
from tangram_celery.sandbox.cgroups import CPU_PERIOD_US, CgroupSet
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
# root inside the container only needs to own files and signal/setuid to the sandbox uid
RUNNER_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETUID", "SETGID"]
LABEL = "tangram.sandbox"


def connect(base_url: str | None, timeout_s: float = 30.0) -> Any:
    """A DockerClient for `base_url` (None: DOCKER_HOST or the default socket), pinged."""
    try:
        import docker
    except ImportError as e:  # pragma: no cover - docker is a core dependency
        raise SandboxError("the docker backend needs the docker package: pip install docker") from e
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

    def __init__(self, cfg: SandboxConfig, limits: Limits | None = None) -> None:
        self.client = connect(cfg.docker_host)
        ensure_image(self.client, cfg.image)
        super().__init__(cfg, limits)

    def _start(self, h: Handle) -> None:
        quota = f"rw,exec,nosuid,nodev,size={self.limits.disk_quota_mb}m"
        volumes = {p: {"bind": p, "mode": "ro"} for p in HOST_RO_PATHS if os.path.exists(p)}
        volumes[str(RUNNER_SRC_DIR)] = {"bind": RUNNER_DIR, "mode": "ro"}
        volumes[str(h.state_dir)] = {"bind": str(Path(RUNNER_SOCKET).parent), "mode": "rw"}
        if self.tools_dir is not None:
            volumes[str(self.tools_dir)] = {"bind": TOOLS_PATH, "mode": "ro"}
        safe = re.sub(r"[^A-Za-z0-9_.-]", "-", h.trajectory_id)[:60]
        cmd = [
            *RUNNER_ARGV,
            "--socket",
            RUNNER_SOCKET,
            "--uid",
            str(SANDBOX_UID),
            "--workdir",
            WORKDIR,
        ]
        try:
            h.ref = self.client.containers.run(
                self.cfg.image,
                cmd,
                detach=True,
                name=f"tangram-{self.owner}-{safe}",
                labels={LABEL: self.owner, "tangram.trajectory": h.trajectory_id[:200]},
                network_mode="none" if not self.limits.network else "host",
                read_only=True,
                tmpfs={WORKDIR: quota, "/tmp": quota},
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
                environment={},
            )
            h.ref.reload()
        except Exception as e:
            raise SandboxError(f"cannot start sandbox container: {e}") from None
        pid = int(h.ref.attrs["State"]["Pid"])
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
        """Cheap when the engine is local: is the runner's host pid still a live process."""
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

    def _destroy(self, h: Handle) -> None:
        if h.ref is None:
            return
        try:
            h.ref.remove(force=True)
        except Exception as e:
            log.debug("remove container of %s: %s", h.trajectory_id, e)

    def close(self) -> None:
        super().close()
        try:  # anything of ours a crashed action may have left behind
            for c in self.client.containers.list(all=True, filters={"label": f"{LABEL}={self.owner}"}):
                c.remove(force=True)
        except Exception as e:
            log.debug("final sweep: %s", e)
        self.client.close()
