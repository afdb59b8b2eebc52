"""Ready sandboxes, started in the background so that no action waits for a sandbox start.

A CPU worker hands a sandbox to each new trajectory and each one-shot action. Starting one
(namespaces or a container, cgroups, the resident runner's interpreter) takes tens of ms; a
`ReadyPool` keeps `size` of them started ahead, refilled by one background thread as they are
taken. A taken sandbox is bound to the action's cores and memory when the action runs, like any
other. When the pool is empty (a burst of new trajectories), the caller starts one itself.
Ready sandboxes are fresh or recycled: a recycled one ran another occupant's code and was then
scrubbed (`WarmPool._recycle`, docs/sandbox.md "Recycling"); up to `keep` of those are kept
(`sandbox.ready_max`, at least twice `size`), so that a scrubbed sandbox is rarely thrown away.
While the worker runs no action, the pool grows, one start at a time, until its sandboxes and
those trajectories hold reach `reserve` (`sandbox.ready_idle`): a burst of new trajectories that
finds no idle trajectory to evict (the first after a start), and so no sandbox to recycle, then
takes ready ones instead of starting its own on the cores its actions need.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
H = TypeVar("H")
RETRY_AFTER_S = 1.0  # after a failed start (the backend is broken: do not spin)
# Background work waits this long after the action that caused it started, so that it does not
# compete for the cores with that very action: a refill (while a ready sandbox is left), and
# the removal of a sandbox that is done.
BACKGROUND_DELAY_S = 0.05
SCRUB_WAIT_S = 2.0  # a taker waits this long at most for a sandbox being scrubbed
# While scrubbed sandboxes keep coming back (trajectories evicted as fast as new ones come, the
# steady state of stateless callers), they are the supply: the filler starts none for this
# long after the last one came back. Else it started one whenever a taker had just emptied the
# pool, and as many scrubbed ones were later thrown away.
RECYCLED_SUPPLY_S = 1.0
# The worker has run no action for this long: the pool may grow beyond `size` (`reserve`).
IDLE_GROW_S = 0.25


def kept_ready(size: int, keep: int | None) -> int:
    """How many ready sandboxes a pool of `size` keeps at most (`sandbox.ready_max` as `keep`):
    at least twice its size."""
    return max(2 * size, keep or 0)


class ReadyPool(Generic[H]):
    """`size` started sandboxes, kept ready by a background thread (`size` 0: none, no thread).

    `start()` returns a started, ready sandbox (blocking), `destroy(h)` removes one, `alive(h)`
    says whether it still runs. Scrubbed sandboxes are kept up to `keep` in all (default
    `2 * size`): a burst of new trajectories (a batch of riders) takes them as fast as the
    trajectories it evicts give them back. With `reserve` above `size`, `quiet_s` (seconds since
    the worker last ran an action, 0 while one runs) and `held` (sandboxes handed out and still
    in use), the pool grows once the worker has been idle for `IDLE_GROW_S` until ready, held
    and scrubbing sandboxes reach `reserve` (ready ones at most `keep`), and stops growing while
    an action runs: those starts never take a core from an action.
    """

    def __init__(
        self,
        size: int,
        start: Callable[[], H],
        destroy: Callable[[H], None],
        alive: Callable[[H], bool],
        keep: int | None = None,
        starved: Callable[[], None] | None = None,
        reserve: int = 0,
        quiet_s: Callable[[], float] | None = None,
        held: Callable[[], int] = lambda: 0,
    ) -> None:
        self.size = size
        self.keep = kept_ready(size, keep)
        # grown to while idle, counting the sandboxes handed out (`quiet_s` given; 0: not at all)
        self.reserve = reserve if quiet_s is not None and size > 0 else 0
        self._quiet_s = quiet_s
        self._held = held
        self._start = start
        self._destroy = destroy
        self._alive = alive
        self._starved = starved  # a taker waits for a sandbox being scrubbed: hurry it
        self._ready: collections.deque[H] = collections.deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a sandbox came back or a scrub ended
        self._pending = 0  # sandboxes being scrubbed for this pool (`expect`)
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self.started = 0  # sandboxes started by the pool (for tests and metrics)
        self.handed_out = 0
        self.recycled = 0  # scrubbed sandboxes taken back
        self._recycled_at = float("-inf")  # monotonic time of the last one
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start filling (idempotent). Not done on construction: a backend starts it once it is
        fully set up (`open_sandbox`), and the first `take` starts it otherwise."""
        with self._lock:
            if self._thread is not None or self.size <= 0 or self._stop.is_set():
                return
            self._wanted.set()
            self._thread = threading.Thread(target=self._fill, name="sandbox-prewarm", daemon=True)
            self._thread.start()

    def take(self, prefer: Callable[[H], bool] | None = None) -> H | None:
        """A ready sandbox, or None when none is (the caller starts its own); the first one
        `prefer` accepts if any (e.g. one already bound to the action's cores). When a sandbox
        is being scrubbed for the pool, waits for it (up to `SCRUB_WAIT_S`): a scrub takes a
        few ms, a start tens to hundreds."""
        if self._thread is None:
            self.start()
        while True:
            with self._lock:
                deadline = time.monotonic() + SCRUB_WAIT_S
                if not self._ready and self._pending and self._starved is not None:
                    self._starved()
                while not self._ready and self._pending and time.monotonic() < deadline:
                    self._changed.wait(deadline - time.monotonic())
                if not self._ready:
                    self._wanted.set()
                    return None
                h = next((x for x in self._ready if prefer(x)), None) if prefer else None
                if h is None:
                    h = self._ready.popleft()
                else:
                    self._ready.remove(h)
            self._wake()
            if self._alive(h):
                with self._lock:
                    self.handed_out += 1
                return h
            log.warning("a ready sandbox died while it waited; discarded")
            self._destroy(h)

    def give_back(self, h: H) -> None:
        """Return an untouched sandbox taken but not used (it is still fresh)."""
        with self._lock:
            if len(self._ready) < self.size and not self._stop.is_set():
                self._ready.appendleft(h)
                self.handed_out -= 1
                return
        self._destroy(h)

    def expect(self) -> None:
        """A sandbox is on its way back (being scrubbed): takers wait for it, the filler does
        not start one in its place. Each `expect` is matched by one `settled`."""
        with self._lock:
            self._pending += 1

    def settled(self) -> None:
        with self._lock:
            self._pending -= 1
            self._changed.notify_all()
        self._wake()  # if it did not come back, the filler makes up for it

    def _missing(self, held: int) -> tuple[int, int]:
        """(short, grow), under the lock: how many sandboxes the pool lacks to reach `size`,
        and to reach its idle reserve (`held` sandboxes handed out and in use)."""
        short = self.size - len(self._ready) - self._pending
        grow = min(self.reserve - held, self.keep) - len(self._ready) - self._pending
        return short, grow

    def _wake(self) -> None:
        """Wake the filler if it has anything to do. Not for every take and every scrubbed
        sandbox back: a stateless caller's steady state (each new trajectory takes one, the one
        it evicts comes back) keeps the pool full, and each needless wake cost the worker two
        thread switches and a turn of the GIL per action."""
        held = self._held() if self.reserve else 0
        with self._lock:
            short, grow = self._missing(held)
        if short > 0 or grow > 0:
            self._wanted.set()

    def recycle(self, h: H) -> bool:
        """Keep a scrubbed sandbox for the next taker (False: the pool is full, destroy it)."""
        with self._lock:
            if len(self._ready) < self.keep and not self._stop.is_set():
                self._ready.append(h)
                self.recycled += 1
                self._recycled_at = time.monotonic()
                self._changed.notify_all()
                return True
        return False

    def __len__(self) -> int:
        with self._lock:
            return len(self._ready)

    def wait_full(self, timeout_s: float) -> bool:
        """Block until `size` sandboxes are ready and none is being scrubbed (for tests and
        benchmarks)."""
        self.start()
        deadline = time.monotonic() + timeout_s
        while len(self) < self.size or self._pending:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Stop refilling and remove the ready sandboxes."""
        with self._lock:
            self._stop.set()
            thread = self._thread
        self._wanted.set()
        if thread is not None:
            thread.join(timeout=60)
        with self._lock:
            left = list(self._ready)
            self._ready.clear()
        for h in left:
            self._destroy(h)

    def _idle_wait(self) -> float:
        """0 when the worker has run no action for `IDLE_GROW_S`; else how long to wait before
        looking again."""
        assert self._quiet_s is not None
        return max(0.0, IDLE_GROW_S - self._quiet_s())

    def _fill(self) -> None:
        while not self._stop.is_set():
            self._wanted.wait()
            held = self._held() if self.reserve else 0  # not under the lock: the caller's own
            with self._lock:
                short, grow = self._missing(held)
                if short <= 0 and grow <= 0:
                    self._wanted.clear()
                    continue
                left = len(self._ready)
                quiet_s = self._recycled_at + RECYCLED_SUPPLY_S - time.monotonic()
            if quiet_s > 0:  # scrubbed ones are coming back: look again once they stop
                self._stop.wait(quiet_s)
                continue
            if short <= 0:  # only the idle reserve is missing: grow while no action runs
                busy_s = self._idle_wait()
                if busy_s > 0:
                    with self._lock:  # a taker empties the pool under the lock, then wakes it
                        self._wanted.clear()
                        short = self.size - len(self._ready) - self._pending
                    if short <= 0:
                        self._wanted.wait(busy_s)
                    self._wanted.set()
                    continue
            elif left and self.started:  # one is still ready: let the taker's action run first
                self._stop.wait(BACKGROUND_DELAY_S)
                with self._lock:  # a sandbox given up meanwhile is being scrubbed for the pool
                    if self.size - len(self._ready) - self._pending <= 0:
                        continue
            try:
                h = self._start()
            except Exception:
                log.exception("starting a ready sandbox failed; retrying in %.0f s", RETRY_AFTER_S)
                self._stop.wait(RETRY_AFTER_S)
                continue
            with self._lock:
                self.started += 1
                if not self._stop.is_set():
                    self._ready.append(h)
                    continue
            self._destroy(h)  # closed while it started


class Disposer(Generic[H]):
    """Removes sandboxes no action will use again, in one background thread, each about
    `delay_s` after it was handed over (off the critical path of the action just started;
    items are due in order, so the delay never accumulates)."""

    def __init__(self, destroy: Callable[[H], None], delay_s: float = BACKGROUND_DELAY_S) -> None:
        self._destroy = destroy
        self.delay_s = delay_s
        self._queue: queue.SimpleQueue[tuple[float, H] | None] = queue.SimpleQueue()
        self._closed = False
        self._hurry = threading.Event()  # someone waits for what is queued: no more delays
        self._thread = threading.Thread(target=self._run, name="sandbox-disposer", daemon=True)
        self._thread.start()

    def put(self, h: H, delay_s: float | None = None) -> None:
        """Queue `h`, due after `delay_s` (default: the disposer's)."""
        if self._closed:
            self._destroy(h)
            return
        self._queue.put((time.monotonic() + (self.delay_s if delay_s is None else delay_s), h))

    def hurry(self) -> None:
        """Handle what is queued now, without waiting for its delay (a taker waits for it)."""
        self._hurry.set()

    def close(self) -> None:
        """Remove everything still queued (at once), then stop."""
        self._closed = True
        self._hurry.set()
        self._queue.put(None)
        self._thread.join(timeout=120)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            due_s, h = item
            wait_s = due_s - time.monotonic()
            if wait_s > 0:
                self._hurry.wait(wait_s)
            try:
                self._destroy(h)
            except Exception:
                log.exception("removing a sandbox failed")
            if self._queue.empty() and not self._closed:
                self._hurry.clear()
