"""Resident runner: PID 1 inside one trajectory's sandbox (stdlib only, runs on the host's python3).

It listens on a unix socket that only root can reach, reads one JSON request per connection,
runs it as the unprivileged sandbox uid and answers one JSON line of *facts* (exit code, output,
flags such as timed_out / output_capped / disk_full); the host turns facts into a status.

Why PID 1: `kill(-1, SIGKILL)` from PID 1 reaches every other process of the sandbox (daemons,
double forks, fork bombs) and nothing outside it, and the sandboxed uid cannot signal PID 1.
Python snippets take the fast path: the runner forks itself and `exec`s the code in the child,
so no interpreter starts per action.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback

try:
    from tangram_celery.sandbox.inside._tangram_jobs import handle
except ImportError:  # inside the sandbox this directory is sys.path[0]
    from _tangram_jobs import handle  # type: ignore[no-redef]


def serve(sock_path: str, uid: int, workdir: str) -> None:
    """Accept one request per connection, forever."""
    for path in (workdir, "/tmp"):
        os.chown(path, uid, uid)
        os.chmod(path, 0o1777 if path == "/tmp" else 0o755)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = sock_path + ".new"
    if os.path.exists(tmp):
        os.unlink(tmp)
    srv.bind(tmp)
    os.chmod(tmp, 0o600)
    srv.listen(8)
    os.rename(tmp, sock_path)  # appears only once it accepts
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        break
                    data += chunk
                req = json.loads(data)
                out: dict
                if req.get("op") == "ping":
                    out = {"pong": True}
                else:
                    out = handle({**req, "uid": uid, "workdir": workdir})
            except Exception as e:
                out = {"runner_error": f"{e!r}\n{traceback.format_exc()[-2000:]}"}
            try:
                conn.sendall(json.dumps(out).encode() + b"\n")
            except OSError:
                pass


def main() -> None:
    args = dict(zip(sys.argv[1::2], sys.argv[2::2], strict=False))
    serve(args["--socket"], int(args["--uid"]), args["--workdir"])


if __name__ == "__main__":
    main()
