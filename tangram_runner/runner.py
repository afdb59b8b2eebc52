"""Resident runner: PID 1 inside one trajectory's sandbox (stdlib only, runs on the host's python3).

It listens on a unix socket that only root can reach, reads one JSON request at a time (over a
connection the host keeps open for the sandbox's occupants, or one of its own:
`control.Connections`), runs it as the unprivileged sandbox uid and answers one JSON line of
*facts* (exit code, output, flags such as timed_out / output_capped / disk_full:
`protocol.Facts`); the host turns facts into a status.

Why PID 1: orphans of user code are reparented to it, and `kill(-1, SIGKILL)` from PID 1 reaches
every other process of the sandbox (daemons, double forks, fork bombs) and nothing outside it;
the sandboxed uid cannot signal PID 1.

The runner holds requests, so nothing is ever forked from its memory: user processes and the
verifiers of assert tests (another uid, `verifier`) come from the zygote (`zygote`,
forked at the runner's start, before it imports its own modules, or exec'd fresh; warm, holding
nothing secret), and expected outputs are compared here. See
docs/sandbox.md, "Threat model".
"""

from __future__ import annotations

import os
import stat
import sys

# Only what the zygote imports too, up to `main`'s fork of it (`forkserver.fork_zygote`);
# the runner's own modules come after (`loop`).
from tangram_runner.forkserver import fork_zygote

_PR_SET_DUMPABLE = 4


def _harden() -> None:
    """No supplementary groups (file operations switch only uid and gid), not dumpable."""
    import ctypes

    os.setgroups([])
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def main() -> None:
    args = dict(zip(sys.argv[1::2], sys.argv[2::2], strict=False))
    _harden()  # first: the zygote inherits it (not dumpable)
    started = fork_zygote()  # before the runner's own modules: see fork_zygote
    from tangram_runner.loop import serve  # the runner's own modules, now

    if args.get("--own"):  # a container image's workdir, handed to the sandbox user once
        own_tree(args["--workdir"], int(args["--uid"]))
    serve(args["--socket"], int(args["--uid"]), args["--workdir"], started)


def own_tree(top: str, uid: int) -> None:
    """`top` (created if missing) and everything below it owned by `uid`: links themselves,
    never followed; a link at `top` is refused."""
    if os.path.islink(top):
        raise SystemExit(f"tangram runner: the workdir {top!r} is a link")
    os.makedirs(top, mode=0o755, exist_ok=True)
    os.lchown(top, uid, uid)
    for d, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(d, name)
            st = os.lstat(path)
            # only what the image put there (root's): a file with another name elsewhere (a
            # hard link) or one a sandbox user already owns is left as it is
            if st.st_uid == 0 and (stat.S_ISDIR(st.st_mode) or st.st_nlink == 1):
                os.lchown(path, uid, uid)


if __name__ == "__main__":
    main()
