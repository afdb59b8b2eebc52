"""The actions the scheduler holds, from intake to their end: the FCFS waiting queue and one
entry per action, queued or dispatched (`Tracked`). The metadata is parsed once, at intake; the
queue entry the policies see (`QueuedAction`) is derived from it and kept beside it, so that
every handler forgets an action the same way (`forget`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from scheduler.model import QueuedAction
from scheduler.queue import WaitingQueue
from tangram_celery.common.wire import ActionMeta, SandboxOrder


@dataclass(slots=True)
class Tracked:
    """One action the scheduler holds: its metadata as the client sent it (persisted in its
    dispatch record), its queue entry, its intake stream id until it is dispatched (acknowledged
    with its dispatch record), its attempt number, and for a dispatched code action the
    sandbox its worker was told to use."""

    meta: ActionMeta
    qa: QueuedAction
    entry: str | None = None
    attempt: int = 0
    sandbox: SandboxOrder | None = None
    dispatched: bool = False


@dataclass
class ActionBook:
    """The waiting queue and every queued or dispatched action (all rebuilt by recovery)."""

    waiting: WaitingQueue = field(default_factory=WaitingQueue)  # FCFS, indexed (scheduler/queue.py)
    _of: dict[str, Tracked] = field(default_factory=dict)

    def __contains__(self, action_id: object) -> bool:
        """Is the action queued or dispatched?"""
        return action_id in self._of

    def get(self, action_id: str) -> Tracked | None:
        return self._of.get(action_id)

    def admit(self, meta: ActionMeta, qa: QueuedAction, entry: str | None = None, attempt: int = 0) -> None:
        """Queue `qa` (at the tail), made from `meta`; `entry`: its intake stream id."""
        self.waiting.append(qa)
        self._of[qa.action_id] = Tracked(meta, qa, entry, attempt)

    def restore_running(
        self, meta: ActionMeta, qa: QueuedAction, attempt: int, sandbox: SandboxOrder | None
    ) -> None:
        """A dispatched action of the previous run (recovery)."""
        self._of[qa.action_id] = Tracked(meta, qa, None, attempt, sandbox, dispatched=True)

    def running(self, action_id: str) -> QueuedAction | None:
        """The queue entry of a dispatched action (None if it is not dispatched)."""
        t = self._of.get(action_id)
        return t.qa if t is not None and t.dispatched else None

    def running_ids(self) -> Iterator[str]:
        return (aid for aid, t in self._of.items() if t.dispatched)

    def attempt(self, action_id: str) -> int:
        """The action's attempt number (0: never dispatched, or not held)."""
        t = self._of.get(action_id)
        return t.attempt if t is not None else 0

    def set_attempt(self, action_id: str, attempt: int) -> None:
        self._of[action_id].attempt = attempt

    def dispatched(self, qa: QueuedAction, sandbox: SandboxOrder | None) -> Tracked:
        """`qa` is sent (again): its next attempt. Its intake entry is left to `take_entry`."""
        t = self._of[qa.action_id]
        t.attempt += 1
        t.dispatched = True
        if sandbox is not None:
            t.sandbox = sandbox
        return t

    def take_entry(self, action_id: str) -> str | None:
        """The intake stream id of a dispatched action, once (acknowledged with its record)."""
        t = self._of.get(action_id)
        if t is None:
            return None
        entry, t.entry = t.entry, None
        return entry

    def requeue(self, action_id: str, solo: bool = False) -> QueuedAction | None:
        """A dispatched action goes back to the waiting queue, in FCFS order (its attempt count
        stays); with `solo`, it never rides again. Returns it if it was dispatched."""
        t = self._of.get(action_id)
        if t is None or not t.dispatched:
            return None
        t.dispatched, t.sandbox = False, None
        t.qa.solo = t.qa.solo or solo
        self.waiting.append(t.qa)
        self.waiting.sort_by_submission()
        return t.qa

    def cancel(self, action_id: str) -> QueuedAction | None:
        """A queued action was withdrawn: it leaves the queue and the book. None if not queued."""
        qa = self.waiting.get(action_id)
        if qa is None:
            return None
        self.waiting.pop(action_id)
        self._of.pop(action_id, None)
        return qa

    def forget(self, action_id: str) -> QueuedAction | None:
        """A dispatched action is over (completed, given up, vanished, cancelled before it was
        sent): everything about it goes. Returns its queue entry if it was dispatched."""
        t = self._of.pop(action_id, None)
        return t.qa if t is not None and t.dispatched else None
