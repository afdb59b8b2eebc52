"""The runner's pool of verifier processes and the seed that forks them (stdlib only).

Verifiers are pooled: a verifier process (uid of its own, never forked from the runner) judges
one test at a time, each in a fresh namespace, and waits for the next; so an assert test costs
one fork (its user process), not two. Test code is trusted; user code never runs in a verifier
and cannot reach one (other uid, not dumpable, seccomp). A verifier judges the tests of one
*group* only: those of one occupant of the sandbox (group "", killed at the next scrub,
scrub), or those of every occupant whose actions name the same group (the worker names
the action's job, `sandbox.verifier_scope`: a new trajectory of the job then needs no verifier
of its own; docs/sandbox.md, "Verifier scope").

Each new verifier is forked from the sandbox's *seed*: a process the zygote forks once with the
verifiers' uid, limits and filter, which warms itself up and never judges a test itself
(zygote.run_seed). A new occupant's first verifier is then a fork of that small, warm
process, not a fork of the zygote followed by the whole set-up. The runner tells a verifier's
end from its pidfd (the seed sends no exit reports); verifiers die with their seed, and the seed
with the zygote.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
from typing import Any

from tangram_runner.forkserver import ForkServer, SpawnFailed, exited

MAX_SEEDS = 2  # seeds for different verifier limits (the rlimit fallback's change per action)


class VerifierSeed(ForkServer):
    """The runner's handle on one seed: forked by the zygote with a verifier's spec."""

    name = "verifier seed"

    def __init__(self, zygote: ForkServer, spec: dict[str, Any], key: str, warm: bool) -> None:
        super().__init__()
        self.zygote, self.spec, self.key, self.warm = zygote, spec, key, warm
        self.pidfd = -1

    def start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        # RLIMIT_NPROC (the rlimit fallback) counts every process of the verifiers' uid on the
        # host: the seed, which forks them all, goes without it; each verifier sets it itself
        rlimits = {k: v for k, v in self.spec.get("rlimits", {}).items() if k != "NPROC"}
        try:
            started, errors = self.zygote.spawn(
                [{**self.spec, "rlimits": rlimits, "mode": "verifier-seed", "fds": 4, "warm": self.warm}],
                [null, null, null, theirs.fileno()],
            )
        finally:
            os.close(null)
            theirs.close()
        if started[0] is None:
            mine.close()
            raise SpawnFailed(errors[0] if errors else "fork failed")
        self.pid, self.pidfd = started[0]
        self.sock, self.ready = mine, False

    def _ended(self) -> bool:
        assert self.pid is not None
        if not exited(self.pidfd):
            return False
        self.zygote.ignore(self.pid)  # its parent, the zygote, reports the exit: nobody takes it
        return True

    def _kill(self) -> None:
        """Its verifiers die with it (parent-death signal)."""
        assert self.pid is not None
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.zygote.ignore(self.pid)

    def lost(self) -> None:
        super().lost()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class Verifier:
    """One pooled verifier process and its control socket (SOCK_SEQPACKET)."""

    def __init__(self, pid: int, pidfd: int, ctl: socket.socket, key: str) -> None:
        self.pid, self.pidfd, self.ctl, self.key = pid, pidfd, ctl, key
        self.fd = ctl.fileno()  # kept: a selector unregisters by number after the close
        self.dead = False
        self.used = False  # handed a job: it has talked to an occupant's user process
        self.group = ""  # the group of the tests it judged ("": one occupant's only)

    def close(self) -> None:
        self.dead = True
        for close in (self.ctl.close, lambda: os.close(self.pidfd)):
            try:
                close()
            except OSError:
                pass


class VerifierPool:
    """Idle verifiers, reused while their limits (uid, cores, rlimits) match the action's."""

    def __init__(self, zygote: ForkServer) -> None:
        self.zygote = zygote
        self.seeds: dict[str, VerifierSeed] = {}  # by limits, the latest last
        self.idle: list[Verifier] = []
        self.live: dict[int, Verifier] = {}
        self.dying: dict[int, int] = {}  # killed, not seen to end yet: pid -> its pidfd

    def pids(self) -> set[int]:
        """The pool's processes that may still hold their pid: seeds, verifiers, killed
        verifiers that have not ended (an ended one's pid may be anyone's by now)."""
        seeds = {s.pid for s in self.seeds.values() if s.pid is not None}
        return seeds | set(self.live) | self.still_dying()

    def still_dying(self) -> set[int]:
        """Killed verifiers that have not exited yet (their pidfd is not readable)."""
        if not self.dying:
            return set()
        poll = select.poll()
        for fd in self.dying.values():
            poll.register(fd, select.POLLIN)
        ended = {fd for fd, _ in poll.poll(0)}
        return {pid for pid, fd in self.dying.items() if fd not in ended}

    def wait_dying(self, timeout_s: float) -> None:
        """Until every killed verifier has ended, `timeout_s` at most."""
        if self.dying:
            poll = select.poll()
            for fd in self.dying.values():
                poll.register(fd, select.POLLIN)
            poll.poll(timeout_s * 1000)
        self.prune()

    def clear_dying(self) -> None:
        for fd in self.dying.values():
            os.close(fd)
        self.dying.clear()

    def prune(self) -> None:
        """Forget verifiers that have ended."""
        for v in [v for v in self.live.values() if exited(v.pidfd)]:
            self.died(v)
        for pid in [p for p, fd in self.dying.items() if exited(fd)]:
            os.close(self.dying.pop(pid))

    def get(self, spec: dict[str, Any], group: str = "") -> Verifier:
        """An idle verifier with these limits that may judge a test of `group` (it never got a
        job, or judged only tests of that group), or a new one. Raises SpawnFailed."""
        self.prune()
        key = json.dumps(spec, sort_keys=True)
        for v in list(self.idle):
            self.idle.remove(v)
            if v.key == key and not v.dead and (not v.used or v.group == group):
                v.used, v.group = True, group
                return v
            self.discard(v)  # other limits or another group: the pool keeps what actions ask for now
        v = self._new(spec, key)
        v.used, v.group = True, group
        return v

    def drop_used(self) -> None:
        """Between occupants (`scrub`): kill every verifier that judged a test of the
        previous occupant's own (group "") and any still busy. One that never got a job has
        talked to no user code, and one of a group (the job of the actions it judged for,
        `sandbox.verifier_scope`) judges that group's tests only (`get`): both stay."""
        for v in [v for v in self.live.values() if (v.used and not v.group) or v not in self.idle]:
            self.discard(v)

    def prime(self, spec: dict[str, Any], warm: bool = True) -> int:
        """Make sure one verifier with these limits is idle: start one now (off an action's
        critical path) unless there is (one kept for a group counts: the next occupant of
        another group then starts its own on its first assert test); with `warm`, it warms itself up (`_new`). Returns how
        many were started. Raises SpawnFailed."""
        self.prune()
        key = json.dumps(spec, sort_keys=True)
        if any(v.key == key and not v.dead for v in self.idle):
            return 0
        self.idle.append(self._new(spec, key, warm=warm))
        return 1

    def _seed(self, spec: dict[str, Any], key: str, warm: bool) -> VerifierSeed:
        """The seed for these limits (started on first use; the oldest of more goes)."""
        seed = self.seeds.pop(key, None)
        if seed is None:
            seed = VerifierSeed(self.zygote, spec, key, warm)
            while len(self.seeds) >= MAX_SEEDS:
                self.seeds.pop(next(iter(self.seeds))).stop()
        self.seeds[key] = seed  # the latest last
        return seed

    def _new(self, spec: dict[str, Any], key: str, warm: bool = False) -> Verifier:
        """Fork a verifier from the seed; with `warm`, it runs a test of its own before it waits
        for jobs (`verifier.warm_up`: its first job then costs what any other does)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        nproc = {k: v for k, v in spec.get("rlimits", {}).items() if k == "NPROC"}
        try:
            started, errors = self._seed(spec, key, warm).spawn(
                [{"fds": 1, "warm": warm, "rlimits": nproc}], [theirs.fileno()]
            )
        finally:
            theirs.close()
        if started[0] is None:
            mine.close()
            raise SpawnFailed(errors[0] if errors else "fork failed")
        pid, pidfd = started[0]
        v = Verifier(pid, pidfd, mine, key)
        self.live[pid] = v
        return v

    def put(self, v: Verifier) -> None:
        if not v.dead and self.live.get(v.pid) is v:
            self.idle.append(v)

    def died(self, v: Verifier) -> None:
        """It has ended: forget it."""
        self.live.pop(v.pid, None)
        if v in self.idle:
            self.idle.remove(v)
        v.close()

    def discard(self, v: Verifier) -> None:
        """Kill it (a test hung in it, or its limits are stale)."""
        if self.live.pop(v.pid, None) is v:
            try:
                signal.pidfd_send_signal(v.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.dying[v.pid], v.pidfd = v.pidfd, -1  # kept until it is seen to end
        if v in self.idle:
            self.idle.remove(v)
        v.close()

    def forget(self) -> None:
        """The zygote is gone: so are (or will be, killed here) its seeds and verifiers."""
        for v in list(self.live.values()):
            try:
                signal.pidfd_send_signal(v.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            v.close()
        for seed in self.seeds.values():
            seed.stop()
        self.seeds.clear()
        self.live.clear()
        self.idle.clear()
        self.clear_dying()
