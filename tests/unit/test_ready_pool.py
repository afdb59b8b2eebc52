"""The ready pool's bookkeeping (tangram_celery.sandbox.prewarm.ReadyPool) with fake sandboxes."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from tangram_celery.sandbox import prewarm
from tangram_celery.sandbox.prewarm import ReadyPool


class Fakes:
    """Sandboxes are ints; starting one is counted, destroying one is recorded."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.started = 0
        self.destroyed: list[int] = []
        self.lock = threading.Lock()

    def start(self) -> int:
        with self.lock:
            self.started += 1
        return next(self.ids)

    def destroy(self, h: int) -> None:
        self.destroyed.append(h)


def _until(cond, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_pool_fills_to_its_size_and_keeps_scrubbed_sandboxes_up_to_keep() -> None:
    """Given size 2 and keep 5, the filler starts 2; scrubbed sandboxes are kept until 5 are
    ready, and the next one is refused (its owner destroys it)."""
    f = Fakes()
    pool: ReadyPool[int] = ReadyPool(2, f.start, f.destroy, lambda h: True, keep=5)
    pool.start()
    _until(lambda: len(pool) == 2)
    assert [pool.recycle(100 + i) for i in range(4)] == [True, True, True, False]
    assert len(pool) == 5 and f.started == 2
    pool.close()
    assert sorted(f.destroyed) == [1, 2, 100, 101, 102]


def test_no_sandbox_is_started_while_scrubbed_ones_keep_coming_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given a pool whose takers are served by scrubbed sandboxes (new trajectories evicting
    idle ones), the filler starts none in their place while they keep coming; once they stop
    coming for RECYCLED_SUPPLY_S, it fills the pool again."""
    monkeypatch.setattr(prewarm, "RECYCLED_SUPPLY_S", 0.3)
    f = Fakes()
    pool: ReadyPool[int] = ReadyPool(2, f.start, f.destroy, lambda h: True, keep=8)
    pool.start()
    _until(lambda: len(pool) == 2)
    for i in range(20):  # every taker empties the pool; a scrubbed one comes back right after
        while pool.take() is not None:
            pass
        assert pool.recycle(1000 + i)
        time.sleep(0.02)
    assert f.started == 2
    while pool.take() is not None:
        pass
    _until(lambda: len(pool) == 2)
    assert f.started == 4
    pool.close()
