"""The sandbox runner's process pump (`proc.Action`) with a real zygote, run from this
process (standing in for the runner)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram_runner.proc import Action, Zygote
from tests.fixtures.runner import run_request, seat

pytestmark = [
    pytest.mark.skipif(os.getuid() != 0, reason="children drop their uid and groups, which needs root"),
]


@pytest.fixture
def zygote() -> Iterator[Zygote]:
    """A zygote, started as the runner starts it."""
    z = Zygote()
    z.start()
    try:
        yield z
    finally:
        z.stop()


def action(workdir: Path, timeout_s: float, zygote: Zygote) -> Action:
    return Action(run_request(timeout_s=timeout_s), seat(workdir), zygote)


def test_a_child_that_closed_its_output_early_does_not_take_a_later_childs_fds(
    tmp_path: Path, zygote: Zygote
) -> None:
    """Given a child A that closes its stdout/stderr at once and exits later, and a child D
    spawned after A's pipes were closed (so D's descriptors reuse their numbers), when A exits,
    then D's output and exit are still D's: A's end must not close or read D's descriptors.
    (This lost a test case's exit in CI: it waited until the deadline and timed out.)"""
    act = action(tmp_path, 20.0, zygote)
    try:
        a = act.spawn("a", None, argv=["/bin/sh", "-c", "exec >&- 2>&-; sleep 1"])
        c = act.spawn("c", None, argv=["/bin/sh", "-c", "sleep 0.3"])
        assert a is not None and c is not None
        assert act.wait_any() is c  # meanwhile A's pipes reached EOF and were closed
        d = act.spawn("d", None, argv=["/bin/sh", "-c", "sleep 1.5; echo d-out; echo d-err >&2"])
        assert d is not None
        done = {act.wait_any(), act.wait_any()}
        assert done == {a, d} and not act.timed_out
        assert (d.returncode, d.stdout, d.stderr) == (0, b"d-out\n", b"d-err\n")
        assert (a.returncode, a.stdout, a.stderr) == (0, b"", b"")
    finally:
        act.close()


def test_user_processes_are_children_of_the_runner_with_stdin_and_limits(
    tmp_path: Path, zygote: Zygote
) -> None:
    """Given a spawn through the zygote, when it runs, then the process is this process's child
    (waited for by pid), got its stdin and its descriptor limit, and holds no other descriptor."""
    act = action(tmp_path, 20.0, zygote)
    try:
        p = act.spawn("p", "in-data\n", argv=["/bin/sh", "-c", "cat; ulimit -n; ls /proc/self/fd | wc -l"])
        assert p is not None and act.wait_any() is p
        out = p.stdout.decode().split()
        assert p.returncode == 0 and out[0] == "in-data" and out[1] == "1024"
        assert int(out[2]) <= 5  # 0, 1, 2 and what ls itself opens
    finally:
        act.close()


def test_a_dead_zygote_is_restarted_on_the_next_spawn(tmp_path: Path, zygote: Zygote) -> None:
    """Given a zygote that died, when a process is spawned, then a new zygote serves it."""
    old = zygote.pid
    assert old is not None
    os.kill(old, 9)
    act = action(tmp_path, 20.0, zygote)
    try:
        p = act.spawn("p", None, argv=["/bin/true"])
        assert p is not None and act.wait_any() is p and p.returncode == 0
        assert zygote.pid not in (None, old)
    finally:
        act.close()


def test_a_killed_verifier_counts_as_dying_only_while_it_holds_its_pid(zygote: Zygote) -> None:
    """Given a pooled verifier killed by the pool (as a scrub does), when it has exited, then
    `still_dying` no longer names it (its pid may be reused), and the pool forgets it at its
    next prune (its pidfd tells its end: the seed that forked it sends no exit reports)."""
    import time

    from tangram_runner.launch import verifier_spec

    pool = zygote.verifiers
    v = pool.get(verifier_spec(run_request(nofile=64), seat("/", 10001)))
    pool.discard(v)
    deadline = time.monotonic() + 10
    while pool.still_dying() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.still_dying() == set() and v.pid in pool.dying
    while v.pid in pool.dying and time.monotonic() < deadline:
        zygote.poll(0.1)
        pool.prune()
    assert pool.dying == {}


def test_verifiers_are_forked_by_a_seed_and_die_with_it(zygote: Zygote) -> None:
    """Given two verifiers of the same limits, then both are children of one verifier seed (a
    child of the zygote), neither is the seed; when the seed is killed, both verifiers die, and
    the next verifier comes from a new seed."""
    import time

    from tangram_runner.launch import verifier_spec

    def ppid(pid: int) -> int:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    pool = zygote.verifiers
    spec = verifier_spec(run_request(nofile=64), seat("/", 10001))
    a, b = pool.get(spec), pool.get(spec)
    (seed,) = pool.seeds.values()
    assert seed.pid is not None and ppid(seed.pid) == zygote.pid
    assert ppid(a.pid) == ppid(b.pid) == seed.pid and seed.pid not in (a.pid, b.pid)
    old = seed.pid
    os.kill(old, 9)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{v.pid}/stat") and ppid(v.pid) for v in (a, b)):
        assert time.monotonic() < deadline, "a verifier outlived its seed"
        time.sleep(0.01)
        pool.prune()
    c = pool.get(spec)
    (new_seed,) = pool.seeds.values()
    assert new_seed.pid not in (None, old) and ppid(c.pid) == new_seed.pid


def test_in_the_rlimit_fallback_the_seed_goes_without_the_process_limit_and_each_verifier_has_it(
    zygote: Zygote,
) -> None:
    """Given a verifier spec with RLIMIT_NPROC (the rlimit fallback: it counts every process of
    the verifiers' uid on the host), then the seed that forks the verifiers does not carry it
    (its forks would fail once enough verifiers of all sandboxes ran), and a verifier does."""

    def max_processes(pid: int) -> str:
        with open(f"/proc/{pid}/limits") as f:
            return next(line.split()[2] for line in f if line.startswith("Max processes"))

    import time

    spec = {"uid": 10002, "workdir": "/", "cores": [], "rlimits": {"NPROC": 77}, "nofile": 64}
    v = zygote.verifiers.get(spec)
    (seed,) = zygote.verifiers.seeds.values()
    assert seed.pid is not None
    deadline = time.monotonic() + 10  # the fork returns before the verifier has set itself up
    while Path(f"/proc/{v.pid}/comm").read_text().strip() != "tangram-verify":
        assert time.monotonic() < deadline, "the verifier never got ready"
        time.sleep(0.01)
    assert max_processes(v.pid) == "77" and max_processes(seed.pid) != "77"
