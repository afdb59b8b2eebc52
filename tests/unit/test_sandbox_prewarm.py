"""The ready pool and the disposer (`tangram_celery/sandbox/prewarm.py`), with stand-in
sandboxes: which ready sandbox a taker gets, and how a waiting taker hurries a scrub."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from tangram_celery.sandbox.prewarm import Disposer, ReadyPool

pytestmark = pytest.mark.unit


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
