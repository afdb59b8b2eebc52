"""The zygote: the clean, warm process every user process is forked from (stdlib only).

The runner holds requests (expected outputs, test code); a process forked from it would carry
them into user code's reach. The zygote is exec'd fresh by the runner, never receives a request,
preloads the interpreter and the common stdlib, and then, per spawn, gets only what that one
process may see: a small spec (argv, env, cores, limits) and descriptors (stdin, stdout, stderr,
the user code as a memfd, the verifier connection of an assert test). So a per-test process
costs a fork, not an interpreter start.

Each spawn is a double fork: the zygote's child forks the user process and exits at once, so the
user process is reparented to the runner (PID 1), which waits for it, reads its exit status and
kills it by pidfd like any child of its own. The zygote runs as root (it must set the child's
uid) and holds nothing secret; user code cannot signal, trace or read it (other uid, not
dumpable, seccomp).

Protocol on descriptor 3 (SOCK_SEQPACKET to the runner): zygote sends b"ready" once; then per
spawn the runner sends a JSON spec with the descriptors as SCM_RIGHTS, and the zygote answers
{"pid": N} or {"error": text, "errno": n}.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys

import _tangram_child as child
import _tangram_seccomp as seccomp
import _tangram_serve as serve

# what model-written solutions import most (HumanEval, MBPP, competitive programming)
PRELOAD = (
    "typing",
    "re",
    "math",
    "cmath",
    "collections",
    "itertools",
    "functools",
    "heapq",
    "bisect",
    "string",
    "hashlib",
    "random",
    "json",
    "copy",
    "operator",
    "fractions",
    "decimal",
    "datetime",
    "dataclasses",
    "enum",
    "traceback",
    "site",
)
MAX_FDS = 8


def preload() -> set[str]:
    """Import PRELOAD; return the top-level module names a user file may shadow."""
    before = set(sys.modules)
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    return {n.partition(".")[0] for n in set(sys.modules) - before} - set(sys.builtin_module_names)


def child_main(spec: dict, fds: list[int], preloaded: set[str]) -> None:  # pragma: no cover - child
    """The user process: never returns."""
    code = 127
    try:
        source = child.read_all(fds[-1]) if spec.get("code") else ""
        n = int(spec["fds"])
        child.setup(
            int(spec["uid"]),
            fds[:n],
            spec["workdir"],
            [int(c) for c in spec.get("cores", [])],
            {str(k): int(v) for k, v in spec.get("rlimits", {}).items()},
            int(spec["nofile"]),
            1000,
        )
        env = {str(k): str(v) for k, v in spec["env"].items()}
        if spec["mode"] == "exec":
            child.default_signals()
            os.execve(spec["argv"][0], spec["argv"], env)
        server = serve.Server(socket.socket(fileno=3)) if spec["mode"] == "serve" else None
        child.prepare_python(env, spec["workdir"], spec["argv0"], preloaded)
        code, main, exc = child.run_main(spec["argv0"], source)
        code = child.flush() or code
        if server is not None:
            if exc is None:
                server.ready(main.__dict__)
                server.serve()
            elif not isinstance(exc, SystemExit):
                server.send(serve.exception_record(exc))
            # after SystemExit the connection just closes: the tests never ran
    except BaseException as e:
        try:
            os.write(2, f"tangram runner: {e!r}\n".encode())
        except OSError:
            pass
    os._exit(code)


def spawn(spec: dict, fds: list[int], preloaded: set[str]) -> dict:
    """Double fork; the user process's pid, as the runner will see it."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        os.close(r)
        os.close(w)
        return {"error": f"fork failed: {e}", "errno": e.errno}
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        try:
            grandchild = os.fork()
        except OSError as e:
            os.write(w, f"-{e.errno}".encode())
            os._exit(0)
        if grandchild == 0:
            os.close(w)
            child_main(spec, fds, preloaded)
        os.write(w, str(grandchild).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    data = os.read(r, 32)
    os.close(r)
    try:
        got = int(data)
    except ValueError:
        return {"error": "spawn failed", "errno": 0}
    if got < 0:
        return {"error": f"fork failed: {os.strerror(-got)}", "errno": -got}
    return {"pid": got}


def main() -> None:
    sock = socket.socket(fileno=3)
    preloaded = preload()
    seccomp.prepare()
    gc.collect()
    gc.freeze()  # forks share these pages instead of copying them on the first collection
    sock.send(b"ready")
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, MAX_FDS)
        except OSError:
            os._exit(1)
        if not msg:
            os._exit(0)  # the runner is gone
        try:
            reply = spawn(json.loads(msg), fds, preloaded)
        except Exception as e:
            reply = {"error": repr(e), "errno": 0}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(reply).encode())


if __name__ == "__main__":
    main()
