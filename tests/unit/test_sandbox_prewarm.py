"""The ready pool and the disposer (`tangram_celery/sandbox/prewarm.py`), with stand-in
sandboxes: which ready sandbox a taker gets, how a waiting taker hurries a scrub, and how an idle
worker's pool grows beyond its size."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tangram_celery.sandbox import prewarm
from tangram_celery.sandbox.prewarm import Disposer, ReadyPool


@dataclass
class Box:
    """A stand-in sandbox, bound to some cores."""

    cores: tuple[int, ...]
    alive: bool = True
    name: str = field(default="")


def pool(size: int = 2, starved: object = None) -> ReadyPool[Box]:
    """A pool that never fills by itself (its starter fails the test), for hand-placed boxes."""

    def start() -> Box:
        raise AssertionError("the pool must not start a sandbox here")

    p: ReadyPool[Box] = ReadyPool(size, start, lambda b: None, lambda b: b.alive, starved=starved)  # type: ignore[arg-type]
    p._thread = threading.current_thread()  # "started": no filler thread
    return p


def test_a_taker_gets_a_ready_sandbox_bound_to_its_cores_when_there_is_one() -> None:
    """Given ready sandboxes bound to cores (0,), (1,) and (0, 1), when takers prefer core 1,
    then core 0, then core 1 again, then they get the (1,) one, the (0,) one, and (with no
    match left) the oldest one left."""
    p = pool(size=3)
    for cores in ((0,), (1,), (0, 1)):
        assert p.recycle(Box(cores))
    assert p.take(lambda b: b.cores == (1,)) == Box((1,))
    assert p.take(lambda b: b.cores == (0,)) == Box((0,))
    assert p.take(lambda b: b.cores == (1,)) == Box((0, 1))
    assert p.take() is None


def test_a_taker_waiting_for_a_scrub_hurries_the_disposer() -> None:
    """Given no ready sandbox and one being scrubbed, when a taker comes, then the pool calls
    `starved` (the disposer stops delaying) and the taker gets the sandbox once it is back."""
    calls: list[int] = []
    p = pool(starved=lambda: calls.append(1))
    p.expect()

    def scrubbed() -> None:
        time.sleep(0.05)
        p.recycle(Box((0,), name="scrubbed"))
        p.settled()

    threading.Thread(target=scrubbed).start()
    got = p.take()
    assert got is not None and got.name == "scrubbed"
    assert calls == [1]


def test_hurry_handles_a_delayed_sandbox_at_once() -> None:
    """Given a disposer holding a sandbox due in 30 s, when it is hurried, then the sandbox is
    handled at once, and one queued after that is handled without waiting either."""
    done: list[str] = []
    d: Disposer[str] = Disposer(done.append, delay_s=30.0)
    try:
        d.put("first")
        time.sleep(0.05)
        assert done == []
        t0 = time.monotonic()
        d.hurry()
        d.put("second", 0.0)
        while len(done) < 2 and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert done == ["first", "second"]
    finally:
        d.close()


class Worker:
    """A stand-in worker for a growing pool: whether an action runs, since when none has, and
    how many sandboxes its trajectories hold."""

    def __init__(self) -> None:
        self.running = False
        self.idle_since = time.monotonic()
        self.held = 0
        self.starts: list[bool] = []  # per start: whether an action was running then

    def quiet_s(self) -> float:
        return 0.0 if self.running else time.monotonic() - self.idle_since

    def start(self) -> Box:
        self.starts.append(self.running)
        return Box((0,))


def growing(w: Worker, size: int = 2, reserve: int = 6, keep: int = 8) -> ReadyPool[Box]:
    return ReadyPool(
        size,
        w.start,
        lambda b: None,
        lambda b: b.alive,
        keep=keep,
        reserve=reserve,
        quiet_s=w.quiet_s,
        held=lambda: w.held,
    )


@contextlib.contextmanager
def filled_while_busy(w: Worker) -> Iterator[ReadyPool[Box]]:
    """A growing pool (size 2) started while the worker runs an action, once it holds 2."""
    w.running = True
    p = growing(w)
    p.start()
    try:
        assert wait_for(lambda: len(p) == 2)
        yield p
    finally:
        p.close()


def wait_for(cond: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_an_idle_pool_grows_to_its_reserve_less_what_trajectories_hold() -> None:
    """Given a worker idle for longer than IDLE_GROW_S whose trajectories hold 1 sandbox, when
    the pool (size 2, reserve 6) fills, then it holds 5 ready sandboxes and starts no more;
    when 3 are taken (held 4 now), then it refills to `size` only: 2 ready."""
    w = Worker()
    w.held = 1
    w.idle_since -= 10
    p = growing(w)
    p.start()
    try:
        assert wait_for(lambda: len(p) == 5)
        time.sleep(0.3)
        assert len(p) == 5 and len(w.starts) == 5
        for _ in range(3):
            assert p.take() is not None
        w.held = 4
        assert wait_for(lambda: len(p) == 2)
        time.sleep(0.3)
        assert len(p) == 2
    finally:
        p.close()


def test_the_pool_grows_beyond_its_size_only_while_no_action_runs() -> None:
    """Given a worker running an action, when the pool fills, then it starts `size` sandboxes
    and no more; when the action ends, then after IDLE_GROW_S it grows to its reserve, and every
    start beyond `size` happened while no action ran."""
    w = Worker()
    with filled_while_busy(w) as p:
        time.sleep(0.6)
        assert len(p) == 2
        w.running, w.idle_since = False, time.monotonic()
        assert wait_for(lambda: len(p) == 6)
        assert w.starts[2:] == [False] * 4


def test_a_taker_that_empties_a_growing_pool_is_refilled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given a pool waiting to grow while an action runs (for 5 s of idleness here), when a
    taker takes both ready sandboxes, then the pool refills to `size` without waiting for the
    worker to be idle."""
    monkeypatch.setattr(prewarm, "IDLE_GROW_S", 5.0)
    with filled_while_busy(Worker()) as p:
        time.sleep(0.1)  # the filler now waits for the worker to be idle
        t0 = time.monotonic()
        assert p.take() is not None and p.take() is not None
        assert wait_for(lambda: len(p) == 2)
        assert time.monotonic() - t0 < 2.0
