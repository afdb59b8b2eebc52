"""The control channel between the replica manager and a replica's Triton instances (issue 38).

Triton's model-control API loads and unloads a model; it has no request that moves a loaded
model's weights. Every instance of a replica (one Triton Python stub process each) therefore
listens on a Unix socket of its own, and the GPU worker sends it one-line commands:

- `offload`: move the weights to their host copy (`backends.weights.Weights`), freeing the device;
- `restore`: copy them back to the device;
- `state`: report where they are.

Each answer is one JSON line: `{"ok": true, "on_device": bool, "seconds": float, "nbytes": int}`
or `{"ok": false, "error": "..."}`. A command reaches every instance of the replica (a request
through Triton would reach only one of them).

The sockets live in a directory private to the user running Triton and the worker (mode 0700,
checked, as ssh-agent checks its own): `$XDG_RUNTIME_DIR` or `/tmp`, then `tangram-ctl-<uid>/`,
then a short hash of the model repository's path, so that `tangram reward deploy` (which writes
the path into each replica's config) and the worker that attaches to it agree, and a socket path
stays under the 107 bytes a Unix socket name may have, however deep the state directory is.
Socket names are hashes too: `<hash(replica)>-<hash(instance)>.sock`.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

COMMANDS = ("offload", "restore", "state")


def _h(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def control_dir(repository: str | os.PathLike[str]) -> Path:
    """Where the control sockets of the replicas of `repository` live (not created here): what
    `record` wrote beside it when it was built, else where the build would put them."""
    recorded = record_path(repository)
    if recorded.exists():
        return Path(recorded.read_text().strip())
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    base = Path(xdg) if xdg and Path(xdg).is_dir() else Path("/tmp")
    return base / f"tangram-ctl-{os.getuid()}" / _h(str(Path(repository).resolve()), 12)


def record(repository: str | os.PathLike[str], directory: Path) -> None:
    """Write `directory` beside `repository` (`<repository>.control`), so that a worker that
    attaches to the deployed server finds the sockets whatever its own environment says."""
    record_path(repository).write_text(str(directory) + "\n")


def record_path(repository: str | os.PathLike[str]) -> Path:
    repo = Path(repository).resolve()
    return repo.with_name(repo.name + ".control")


def ensure_private(path: Path) -> Path:
    """Create `path` (and its parent) as directories only this user can enter; PermissionError
    when one exists that another user owns or others can enter (somebody planted it)."""
    for d in (path.parent, path):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"{d}: not a private directory of uid {os.getuid()}; remove it")
    return path


def socket_prefix(replica: str) -> str:
    return _h(replica, 12) + "-"


def socket_path(directory: Path, replica: str, instance: str) -> Path:
    return directory / f"{socket_prefix(replica)}{_h(instance, 8)}.sock"


class ControlServer:
    """The instance side: answers commands on its socket in a daemon thread. `handle(cmd)`
    returns the answer's fields; an exception becomes `{"ok": false}`."""

    def __init__(self, path: Path, handle: Callable[[str], dict[str, Any]]) -> None:
        self.path = path
        self.handle = handle
        ensure_private(path.parent)
        path.unlink(missing_ok=True)  # a socket left by a crashed instance of the same name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o600)
        self.sock.listen(8)
        threading.Thread(target=self._serve, name="tangram-control", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    cmd = conn.makefile("r").readline().strip()
                    if cmd not in COMMANDS:
                        raise ValueError(f"unknown command {cmd!r}")
                    answer = {"ok": True, **self.handle(cmd)}
                except Exception as e:  # an answer, never a dead control thread
                    answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                try:
                    conn.sendall((json.dumps(answer) + "\n").encode())
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)


class ControlError(Exception):
    """An instance did not carry a command out (or could not be reached)."""


def instance_sockets(directory: Path, replica: str) -> list[Path]:
    return sorted(directory.glob(socket_prefix(replica) + "*.sock"))


def send(path: Path, cmd: str, timeout_s: float) -> dict[str, Any]:
    """One command to one instance; its answer (ControlError if it failed)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(str(path))
            s.sendall(cmd.encode() + b"\n")
            line = s.makefile("r").readline()
        except OSError as e:
            raise ControlError(f"{path.name}: {type(e).__name__}: {e}") from e
    try:
        answer: dict[str, Any] = json.loads(line)
    except ValueError as e:
        raise ControlError(f"{path.name}: no answer to {cmd!r}") from e
    if not answer.get("ok"):
        raise ControlError(f"{path.name}: {answer.get('error', 'failed')}")
    return answer


def command(
    directory: Path, replica: str, cmd: str, instances: int, timeout_s: float = 60.0
) -> list[dict[str, Any]]:
    """`cmd` to every instance of `replica`, in parallel; their answers. ControlError unless
    exactly `instances` instances answer it (a missing or extra socket means the replica is not
    the one the manager thinks it is: it must not be counted on)."""
    paths = instance_sockets(directory, replica)
    if len(paths) != instances:
        raise ControlError(f"{replica}: {len(paths)} control socket(s) in {directory}, expected {instances}")
    if len(paths) == 1:
        return [send(paths[0], cmd, timeout_s)]
    with ThreadPoolExecutor(len(paths)) as pool:
        return list(pool.map(lambda p: send(p, cmd, timeout_s), paths))
