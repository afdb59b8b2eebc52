"""A real `tritonserver` process (from the nvidia-pytriton wheel) and model control through tritonclient.

The server runs in explicit model-control mode on 127.0.0.1 with free HTTP/gRPC/metrics ports,
with every API but health restricted (`--http-restricted-api`, `--grpc-restricted-protocol`) to
callers sending the header `RESTRICTED_HEADER` with a random key made at each start (issue 37):
only the process that started it (the GPU worker, or `tangram reward deploy` through the 0600
`server.json`) can load, unload, list or query models. Triton takes the key on its command line
only (it has no config file or environment setting for it): docs/reward_servers.md says what
that leaves open and how to close it.
Its Python-backend stub embeds libpython3.x: the running interpreter's own lib directory goes first
on LD_LIBRARY_PATH, else the stub picks up another CPython and dies at start.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from reward_servers.backends.deps import require
from reward_servers.control import ControlError, command
from reward_servers.errors import ModelLoadFailed, TritonCrashed
from tangram_celery.common import lifeline
from tangram_celery.common.errors import RewardServerError

# The header Triton checks on restricted APIs (lower case: gRPC metadata keys must be).
RESTRICTED_HEADER = "tangram-triton-key"
# Every API but health (server live/ready, model ready): what a liveness probe may still ask.
RESTRICTED_APIS = "metadata,inference,shared-memory,model-config,model-repository,statistics,trace,logging"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ServerInfo:
    """What a client needs to reach a running server, persisted by `deploy`."""

    pid: int
    http_port: int
    grpc_port: int
    metrics_port: int
    repository: str
    log_path: str
    api_key: str = ""  # the restricted APIs' key; "" for a server started before issue 37

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def save(self, path: Path) -> None:
        """Write to `path`, readable by its owner only (it holds the key)."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> ServerInfo:
        return cls(**json.loads(path.read_text()))


def triton_dist() -> tuple[Path, Path, Path]:
    """(tritonserver binary, python backend dir, shared libs dir) of the installed wheel."""
    pkg = Path(require("pytriton").__file__ or "pytriton").parent
    root = pkg / "tritonserver"
    libs = pkg.parent / "nvidia_pytriton.libs"
    return root / "bin" / "tritonserver", root / "backends" / "python", libs


def prepare_backends(work_dir: Path) -> Path:
    """A backend directory whose python backend has this interpreter's stub (symlinks, no copies)."""
    _, py_backend, _ = triton_dist()
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = py_backend.parent.parent / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RewardServerError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    target = work_dir / "backends" / "python"
    target.mkdir(parents=True, exist_ok=True)
    for src in [*py_backend.iterdir(), stub]:
        if src.name == "__pycache__":
            continue
        link = target / src.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)
    return target.parent


def server_env() -> dict[str, str]:
    """Environment for tritonserver: our libpython first, then the wheel's libs; our bin on PATH."""
    _, _, libs = triton_dist()
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or str(Path(sys.base_prefix) / "lib")
    rest = env.get("LD_LIBRARY_PATH", "")
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, str(libs), rest) if p)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def pid_alive(pid: int) -> bool:
    """True when `pid` runs and is a tritonserver (guards against a recycled pid)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    return b"tritonserver" in cmd and stat[0] != "Z"


def http_ok(url: str, path: str = "/v2/health/live", timeout_s: float = 2.0) -> bool:
    """True when GET http://url/path answers 200 within `timeout_s`."""
    try:
        with urllib.request.urlopen(f"http://{url}{path}", timeout=timeout_s) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


class TritonServer:
    """Starts, checks, restarts and stops one tritonserver process."""

    def __init__(
        self,
        repository: str | os.PathLike[str],
        work_dir: str | os.PathLike[str],
        *,
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.repository = Path(repository).resolve()
        self.work_dir = Path(work_dir).resolve()
        self.startup_timeout_s = startup_timeout_s
        self.info: ServerInfo | None = None
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    @classmethod
    def attach(cls, info: ServerInfo, work_dir: str | os.PathLike[str]) -> TritonServer:
        """Adopt a server started elsewhere (`tangram reward deploy`), tracked by its pid."""
        server = cls(info.repository, work_dir)
        server.info = info
        return server

    @property
    def url(self) -> str:
        if self.info is None:
            raise TritonCrashed("tritonserver is not started")
        return self.info.url

    def start(self, *, detach: bool = False) -> ServerInfo:
        """Start on free ports and wait until live; raises RewardServerError with the log tail."""
        binary, _, _ = triton_dist()
        backends = prepare_backends(self.work_dir)
        log_path = self.work_dir / "tritonserver.log"
        last = ""
        key = secrets.token_urlsafe(32)  # a new one at every start: a restart rotates it
        for _attempt in range(3):  # a port can be taken between picking and binding
            ports = (free_port(), free_port(), free_port())
            args = server_args(binary, self.repository, backends, ports, key)
            with open(log_path, "ab") as log:
                # A detached server outlives us (`tangram reward deploy`). Any other dies with
                # its owner, even a SIGKILLed one: an exec wrapper arms PDEATHSIG and checks the
                # parent before tritonserver runs, and since PDEATHSIG fires when the spawning
                # *thread* exits, every server, restarts included (they come from a
                # health-check thread), is spawned by one thread that lives as long as this
                # process.
                if detach:
                    proc = _popen(args, log)
                else:
                    wrapped = lifeline.wrapper_argv(args, os.getpid(), signal.SIGTERM)
                    proc = lifeline.spawn(_popen, wrapped, log)
            info = ServerInfo(proc.pid, *ports, str(self.repository), str(log_path), key)
            if self._wait_live(proc, info):
                self._proc, self.info = proc, info
                if detach:
                    self._proc = None  # outlives us; tracked by pid
                return info
            kill_group(proc.pid)
            proc.wait(timeout=10)
            last = self.log_tail()
        raise RewardServerError(f"tritonserver did not start; log tail:\n{last}")

    def _wait_live(self, proc: subprocess.Popen[bytes], info: ServerInfo) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            if http_ok(info.url):
                return True
            time.sleep(0.1)
        return False

    def alive(self) -> bool:
        """True when the process runs and answers the liveness probe."""
        if self.info is None:
            return False
        if self._proc is not None and self._proc.poll() is not None:
            return False
        return pid_alive(self.info.pid) and http_ok(self.info.url)

    def ensure_running(self) -> bool:
        """Restart the server if it died; True when a restart happened."""
        with self._lock:
            if self.alive():
                return False
            if self.info is not None:
                # Its Python stubs outlive it and hold the listening sockets (clients would hang):
                # the whole process group goes.
                kill_group(self.info.pid)
            self.restarts += 1
            self.start()
            return True

    def log_tail(self, lines: int = 20) -> str:
        path = self.work_dir / "tritonserver.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM our server by pid, SIGKILL after `timeout_s`."""
        if self.info is None:
            return
        stop_pid(self.info.pid, timeout_s, self._proc)
        self.info, self._proc = None, None


def server_args(
    binary: Path, repository: Path, backends: Path, ports: tuple[int, int, int], key: str
) -> list[str]:
    """tritonserver's command line: loopback only, explicit model control, no metrics, and
    every API but health restricted to callers sending `RESTRICTED_HEADER: key`."""
    restricted = f"{RESTRICTED_APIS}:{RESTRICTED_HEADER}={key}"
    return [
        str(binary),
        f"--model-repository={repository}",
        f"--backend-directory={backends}",
        "--model-control-mode=explicit",
        "--http-address=127.0.0.1",
        "--grpc-address=127.0.0.1",
        f"--http-port={ports[0]}",
        f"--grpc-port={ports[1]}",
        f"--metrics-port={ports[2]}",
        "--allow-metrics=false",
        f"--http-restricted-api={restricted}",
        f"--grpc-restricted-protocol={restricted}",
        "--pinned-memory-pool-byte-size=0",
        "--exit-timeout-secs=2",
        "--strict-readiness=false",
    ]


def _popen(args: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, env=server_env(), start_new_session=True
    )


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal the process group led by our tritonserver `pid` (its stubs included)."""
    try:
        os.killpg(pid, sig)  # started with its own session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """True while a process of the process group `pgid` exists (a zombie counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_pid(pid: int, timeout_s: float = 10.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Stop the tritonserver `pid` (SIGTERM, then SIGKILL), and its Python stubs with it: it
    returns once the whole process group is gone (the stubs exit after the server, so waiting
    for the server alone left them running after a `tangram up` had ended)."""
    if not pid_alive(pid):
        kill_group(pid)  # leftover stubs of a crashed server
        if proc is not None:
            proc.wait(timeout=10)
        return
    kill_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server_gone = proc.poll() is not None if proc is not None else not pid_alive(pid)
        if server_gone and not group_alive(pid):
            return
        time.sleep(0.05)
    kill_group(pid)
    if proc is not None:
        proc.wait(timeout=10)


class TritonController:
    """Model control over HTTP with tritonclient: load, unload, readiness (one client per
    thread); and, through the replicas' control sockets (`reward_servers.control`, in the
    directory `control`), moving a loaded replica's weights between the device and host memory."""

    def __init__(
        self,
        url: str,
        *,
        network_timeout_s: float = 300.0,
        control: Path | None = None,
        api_key: str = "",
    ) -> None:
        self.url = url
        self.network_timeout_s = network_timeout_s
        self.control = control
        self.api_key = api_key
        self._local = threading.local()

    @classmethod
    def of(cls, info: ServerInfo, *, control: Path | None = None) -> TritonController:
        """A controller of the server `info` describes, with its restricted APIs' key."""
        return cls(info.url, control=control, api_key=info.api_key)

    @property
    def headers(self) -> dict[str, str]:
        """Sent with every call: the restricted APIs refuse a call without it."""
        return {RESTRICTED_HEADER: self.api_key} if self.api_key else {}

    def client(self, concurrency: int = 1) -> Any:
        """This thread's tritonclient.http client with at least `concurrency` connections."""
        cache: dict[int, Any] = self._local.__dict__.setdefault("clients", {})
        if concurrency not in cache:
            http = require("tritonclient.http")
            cache[concurrency] = http.InferenceServerClient(
                self.url, concurrency=concurrency, network_timeout=self.network_timeout_s
            )
        return cache[concurrency]

    def retarget(self, url: str, api_key: str | None = None) -> None:
        """Point at a restarted server (new ports, new key): clients are rebuilt lazily."""
        self.url = url
        if api_key is not None:
            self.api_key = api_key
        self._local = threading.local()

    def load(self, name: str) -> None:
        """Load `name`; raises ModelLoadFailed with Triton's reason, TritonCrashed if unreachable."""
        try:
            self.client().load_model(name, headers=self.headers)
        except Exception as e:
            if _is_connection_error(e):
                raise TritonCrashed(f"tritonserver at {self.url} unreachable: {e}") from None
            raise ModelLoadFailed(name, str(e)) from None

    def unload(self, name: str) -> None:
        try:
            self.client().unload_model(name, headers=self.headers)
        except Exception as e:
            if _is_connection_error(e):
                raise TritonCrashed(f"tritonserver at {self.url} unreachable: {e}") from None
            raise RewardServerError(f"unloading {name!r} failed: {e}") from None

    def offload(self, name: str, instances: int) -> float:
        """Move `name`'s weights to host memory on every instance; the longest instance's
        seconds. RewardServerError if an instance did not (the caller unloads it instead)."""
        return self._move(name, "offload", instances)

    def restore(self, name: str, instances: int) -> float:
        """Copy `name`'s weights back to the device on every instance; the longest instance's
        seconds. RewardServerError if an instance did not (the caller unloads it)."""
        return self._move(name, "restore", instances)

    def _move(self, name: str, cmd: str, instances: int) -> float:
        if self.control is None:
            raise RewardServerError(f"{cmd} {name!r}: this server has no host tier (no control directory)")
        try:
            answers = command(self.control, name, cmd, instances)
        except ControlError as e:
            raise RewardServerError(f"{cmd} {name!r} failed: {e}") from None
        return max(float(a.get("seconds", 0.0)) for a in answers)

    def forget_controls(self) -> None:
        """Remove the control sockets a dead server's instances left (after a restart)."""
        if self.control is not None and self.control.is_dir():
            for p in self.control.glob("*.sock"):
                p.unlink(missing_ok=True)

    def is_ready(self, name: str) -> bool:
        try:
            return bool(self.client().is_model_ready(name, headers=self.headers))
        except Exception as e:
            if _is_connection_error(e):
                raise TritonCrashed(f"tritonserver at {self.url} unreachable: {e}") from None
            return False

    def loaded(self) -> dict[str, str]:
        """Triton's view of the repository: model name -> state, for models that have one."""
        index = self.client().get_model_repository_index(headers=self.headers)
        return {m["name"]: m.get("state", "") for m in index if m.get("state")}


def _is_connection_error(e: Exception) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return isinstance(e, OSError | ConnectionError) or any(
        w in text for w in ("connection", "broken pipe", "timed out", "eof", "remote end")
    )
