"""Core loans on one CPU node, as its worker carries them out (pure bookkeeping, thread-safe).

The scheduler lends spare cores to running malleable actions (test suites given as test cases)
and sends each change as a `wire.CoreLoan`: every core lent to one borrower now, numbered by
`seq` (`scheduler.service.sender`). The worker keeps, per running action, its own cores (its
allocation) and the cores on loan to it, and resizes the action's sandbox to their union
(`Sandbox.resize`). The worker also keeps the node's cores exclusive on its own, whatever order
the messages arrive in:

- an action that starts takes its own cores back from every borrower first (the scheduler's
  take-back may still be on its way, or queued behind the action itself);
- a core lent to one borrower is taken from any other that had it, and a core that a running
  action owns is never lent;
- a loan older (`seq`) than the borrower's last one is dropped;
- a loan for an action that has not started here yet is kept for its start (its message may come
  after the loan); one for an action that ended here is dropped.

Every method returns the actions whose cores changed, which the caller resizes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from tangram_celery.common.wire import CoreLoan

Cores = frozenset[int]
KEEP_S = 600.0  # how long a loan waits for its action's start, and an ended action is remembered
MAX_ENDED = 1 << 16  # ended actions remembered at most (the oldest are forgotten first)


class CoreLoans:
    """The running actions of one node with their own and lent cores (see the module doc)."""

    def __init__(self, keep_s: float = KEEP_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s = keep_s
        self.clock = clock
        self._lock = threading.Lock()
        self._own: dict[str, Cores] = {}
        self._lent: dict[str, Cores] = {}
        self._seq: dict[str, int] = {}
        self._early: dict[str, tuple[Cores, float]] = {}  # loans before their action's start
        self._ended: OrderedDict[str, float] = OrderedDict()  # oldest end first

    def start(self, action_id: str, own: Iterable[int]) -> tuple[tuple[int, ...], list[str]]:
        """`action_id` starts on `own`: its cores now (its own, plus a loan that came first),
        and the borrowers those cores were taken back from."""
        own_set = frozenset(own)
        with self._lock:
            self._ended.pop(action_id, None)
            changed = self._take(own_set, action_id)
            self._own[action_id] = own_set
            early = self._early.pop(action_id, None)
            if early is not None:
                lent = self._lendable(early[0], action_id)
                changed += self._take(lent, action_id)
                if lent:
                    self._lent[action_id] = lent
            return self._cores(action_id), changed

    def lend(self, loan: CoreLoan) -> list[str]:
        """Carry out one loan; returns the actions whose cores changed (the borrower, and those
        a lent core was taken from)."""
        aid = loan.action_id
        with self._lock:
            if loan.seq <= self._seq.get(aid, 0) or aid in self._ended:
                return []
            self._seq[aid] = loan.seq
            if aid not in self._own:  # its message has not reached this worker yet
                now = self.clock()
                self._early = {a: e for a, e in self._early.items() if now - e[1] < self.keep_s}
                self._early[aid] = (frozenset(loan.cores), now)
                return []
            lent = self._lendable(frozenset(loan.cores), aid)
            changed = self._take(lent, aid)
            if lent != self._lent.get(aid, frozenset()):
                if lent:
                    self._lent[aid] = lent
                else:
                    self._lent.pop(aid, None)
                changed.append(aid)
            return changed

    def end(self, action_id: str) -> None:
        """`action_id` ended: its own and lent cores are free."""
        with self._lock:
            self._own.pop(action_id, None)
            self._lent.pop(action_id, None)
            self._seq.pop(action_id, None)
            self._early.pop(action_id, None)
            now = self.clock()
            ended = self._ended
            ended.pop(action_id, None)
            ended[action_id] = now
            # forget from the oldest end on: O(1) per call, where a sweep of the whole map on
            # every end made each cost as much as the actions of the last `keep_s` seconds
            while ended:
                aid, t = next(iter(ended.items()))
                if now - t < self.keep_s and len(ended) <= MAX_ENDED:
                    break
                del ended[aid]

    def cores(self, action_id: str) -> tuple[int, ...] | None:
        """The running action's cores now (own and lent), or None if it is not running."""
        with self._lock:
            return self._cores(action_id) if action_id in self._own else None

    def lent(self) -> dict[str, tuple[int, ...]]:
        """Borrower -> its lent cores (for reports and tests)."""
        with self._lock:
            return {a: tuple(sorted(c)) for a, c in self._lent.items()}

    # ---- under the lock ------------------------------------------------------------------------
    def _cores(self, aid: str) -> tuple[int, ...]:
        return tuple(sorted(self._own[aid] | self._lent.get(aid, frozenset())))

    def _lendable(self, cores: Cores, aid: str) -> Cores:
        """`cores` without those a running action owns (the borrower's own among them)."""
        owned = frozenset().union(*self._own.values()) if self._own else frozenset()
        return cores - owned

    def _take(self, cores: Cores, keep: str) -> list[str]:
        """Take `cores` back from every borrower but `keep`; returns those it changed."""
        changed: list[str] = []
        if not cores:
            return changed
        for aid, lent in list(self._lent.items()):
            if aid != keep and not lent.isdisjoint(cores):
                rest = lent - cores
                if rest:
                    self._lent[aid] = rest
                else:
                    del self._lent[aid]
                changed.append(aid)
        return changed
