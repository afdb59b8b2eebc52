"""What a process of an action is started with (its spec for the zygote, its descriptors) and
what the runner keeps of it while it runs (`Proc`); the programs the runner compiles for them."""

from __future__ import annotations

import marshal
import os
import warnings
from typing import TYPE_CHECKING, Any

from tangram_runner.forkserver import memfd
from tangram_runner.verifiers import Verifier

if TYPE_CHECKING:
    from tangram_runner.protocol import RunRequest, Seat

# what assert_code is compiled as: proxy.TEST_FILENAME (not imported here: the runner
# does not need the proxies, and what it imports shapes the zygote's heap, forked from it)
TEST_FILENAME = "<test>"
MAX_RUNNER_COMPILE = 1 << 16  # characters of a program the runner compiles (`compiled_payload`)
DEFAULT_NOFILE = 1024


def user_limits(req: RunRequest, seat: Seat) -> dict[str, Any]:
    """The limits every process of a request is spawned with (a user process's spec)."""
    # the cgroup cpuset binds the cores; only without cgroups (rlimit fallback) does each
    # process pin itself
    cores = [int(c) for c in req.cores] if req.rlimits else []
    return {
        "uid": int(seat.uid),
        "workdir": seat.workdir,
        "cores": cores,
        "rlimits": dict(req.rlimits or {}),  # None: not sent (cgroups)
        "nofile": int(req.nofile or DEFAULT_NOFILE),
    }


def verifier_spec(req: RunRequest, seat: Seat) -> dict[str, Any]:
    """The spec of a verifier for a request's assert tests; pooled verifiers are reused while
    it stays the same (with cgroups it does not depend on the request's cores or memory)."""
    return {**user_limits(req, seat), "uid": int(seat.uid) + 1, "oom_score_adj": 500}


def compiled_payload(source: str, filename: str) -> tuple[bytes, bool]:
    """What a process that runs `source` gets of it: the marshalled (source, code object),
    compiled here as `filename`, and True; or the source itself, and False, when it does not
    compile cleanly here (a syntax error, any warning the compiler gives: the process then
    compiles it, under the action's deadline, and shows the error or the warning as `python3`
    would) or is larger than `MAX_RUNNER_COMPILE` (compiled in the process, under the deadline,
    not in the runner). Compiling here rather than in each forked process keeps the compiler
    off the pages the process shares with its parent: a compile in a fresh fork is a
    copy-on-write fault on every page the compiler writes. The marshalled code goes in a memfd
    to processes of the action only, which read it before they drop to the sandbox uid and
    close every descriptor they were not given (`child.setup`): user code never holds
    it."""
    if len(source) <= MAX_RUNNER_COMPILE:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                code = compile(source, filename, "exec", dont_inherit=True)
            return marshal.dumps((source, code)), True
        except Exception:
            pass
    return source.encode("utf-8", "surrogatepass"), False


def main_file(workdir: str, unit: str) -> str:
    """What `python3 unit` run in `workdir` calls its main module (`__file__`, and the file its
    tracebacks name): the absolute path (`sys.argv[0]` stays `unit`). The runner compiles a
    program under this name (`proc.code_memfd`) and tells its processes (`proc.Action.user_launch`)."""
    return os.path.join(workdir, unit)


def assert_payload(assert_code: str) -> tuple[bytes, bool]:
    """What a verifier gets of one assert test (`compiled_payload`): a new occupant's verifier
    judges one test or two, so the compile stays off its pages too. The test code is trusted;
    the verifier reports why it does not compile."""
    return compiled_payload(assert_code, TEST_FILENAME)


class Proc:
    """One process of the current action (or one test job of a pooled verifier, with `verifier`
    set and no pidfd of its own) and what it wrote so far, per stream name."""

    def __init__(self, pid: int, pidfd: int | None, tag: object, streams: dict[int, str], user: bool) -> None:
        self.pid, self.pidfd, self.tag, self.user = pid, pidfd, tag, user
        self.fds = dict(streams)  # fd -> stream name
        self.bufs = {name: bytearray() for name in streams.values()}
        self.returncode: int | None = None
        self.killed_by_runner = False  # its SIGKILL is no limit's doing
        self.verifier: Verifier | None = None
        self.job_id = 0
        self.pending: int | None = None  # a job's end, seen and not yet taken
        # a compiler: its output is truncated at the cap without ending the action (a long
        # list of diagnostics is a failed compile, not an output limit)
        self.truncate_only = False

    @property
    def stdout(self) -> bytes:
        return bytes(self.bufs.get("out", b""))

    @property
    def stderr(self) -> bytes:
        return bytes(self.bufs.get("err", b""))

    def stream(self, name: str) -> bytes:
        return bytes(self.bufs.get(name, b""))


class Launch:
    """One process to start: its spec for the zygote, the descriptors it gets (sent, then closed
    here), and the pipes whose read ends the runner keeps, by stream name."""

    def __init__(self, tag: object, spec: dict[str, Any], user: bool) -> None:
        self.tag, self.spec, self.user = tag, spec, user
        self.send: list[int] = []
        self.streams: dict[int, str] = {}
        self.mine: list[int] = []  # our copies to close once sent

    def pipe(self, name: str) -> None:
        r, w = os.pipe()
        self.streams[r] = name
        self.send.append(w)
        self.mine.append(w)

    def memfd(self, data: bytes, name: str) -> None:
        fd = memfd(data, name)
        self.send.append(fd)
        self.mine.append(fd)
