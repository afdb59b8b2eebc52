"""Turns on a CPU worker's cores: actions sent for the same cores run one after another.

The scheduler sends a batch of short actions for cores it holds (`scheduler.policies.cpu_batch`)
and, while the last actions of a batch run, the next batch for the same cores, queued behind
them: its message is on its way while they run, instead of the cores idling through a round,
a message and a claim after they end. That message may reach a free thread of the worker while
the batch before it still runs; it waits here for its turn on those cores. A time sharer
(`shares`) takes no turn: it runs beside the action that holds its cores by design.

A waiter that does not get its turn within the batch hand-back limit gives its actions back to
the scheduler, as the riders of an action that overran do (`WorkerRuntime.execute_batch`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tangram_celery.common.wire import TaskOrder


def turn_key(order: TaskOrder) -> tuple[int, ...] | None:
    """The cores an order must have to itself, one action at a time (None: it takes no turn)."""
    if order.kind != "cpu" or order.shares or not order.unit_ids:
        return None
    return tuple(order.unit_ids)


class CoreTurns:
    """One lock per set of cores in use, dropped once nobody holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[tuple[int, ...], tuple[threading.Lock, int]] = {}

    @contextmanager
    def turn(self, key: tuple[int, ...] | None, timeout_s: float) -> Iterator[bool]:
        """Hold the turn on `key`'s cores while inside; yields False (and holds nothing) when it
        did not come within `timeout_s` (<= 0: wait for as long as it takes). No key: True."""
        if key is None:
            yield True
            return
        with self._guard:
            lock, users = self._locks.get(key, (None, 0))
            if lock is None:
                lock = threading.Lock()
            self._locks[key] = (lock, users + 1)
        got = lock.acquire(timeout=timeout_s if timeout_s > 0 else -1)
        try:
            yield got
        finally:
            if got:
                lock.release()
            with self._guard:
                _, users = self._locks[key]
                if users > 1:
                    self._locks[key] = (lock, users - 1)
                else:
                    del self._locks[key]

    def waiting(self) -> int:
        """How many callers hold or wait for a turn (for tests and debugging)."""
        with self._guard:
            return sum(users for _, users in self._locks.values())
