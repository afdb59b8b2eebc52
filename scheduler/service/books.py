"""The scheduler's bookkeeping beside `ClusterState`: what it knows of each action and trajectory
between intake and completion. Plain dicts, kept in one place so that every handler forgets an
action the same way (`forget`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from scheduler.gpu_cache import Chunk
from scheduler.model import QueuedAction
from scheduler.service.sandboxes import SandboxBook
from tangram_celery.common.wire import ActionMeta, GpuWarm, SandboxOrder


@dataclass
class Warming:
    """A warm GPU order (`wire.GpuWarm`) sent at `sent_s` and not answered yet."""

    order: GpuWarm
    sent_s: float


@dataclass
class Books:
    """What the scheduler knows beyond the resource state (all rebuilt by recovery)."""

    # queued action -> its intake stream id (acknowledged when it is dispatched)
    entry_of: dict[str, str] = field(default_factory=dict)
    # queued or dispatched action -> its metadata as the client sent it
    meta: dict[str, ActionMeta] = field(default_factory=dict)
    # dispatched action -> its queue entry (trajectory key, kind, cost)
    running: dict[str, QueuedAction] = field(default_factory=dict)
    # dispatched (or re-routed) action -> its attempt number
    attempt: dict[str, int] = field(default_factory=dict)
    # dispatched code action -> the sandbox its worker was told to use
    sandbox_of: dict[str, SandboxOrder] = field(default_factory=dict)
    # trajectory -> its queued + running actions
    active: Counter[str] = field(default_factory=Counter)
    # trajectory -> stream id of its close request (closed once nothing of it is active)
    closing: dict[str, str] = field(default_factory=dict)
    # pinned trajectory -> when one of its actions was last dispatched or completed (s)
    last_active: dict[str, float] = field(default_factory=dict)
    # sandbox generations, owners and pending resets of the pinned trajectories
    sandboxes: SandboxBook = field(default_factory=SandboxBook)
    # warm GPU orders sent and not answered yet (service/elastic.py)
    warming: dict[tuple[str, Chunk, str], Warming] = field(default_factory=dict)
    # warm orders (restores, retirements) that failed, when: not sent again for a while
    warm_failed: dict[tuple[str, Chunk, str], float] = field(default_factory=dict)

    def dispatched(self, qa: QueuedAction, sandbox: SandboxOrder | None) -> int:
        """`qa` is sent (again): its next attempt number."""
        aid = qa.action_id
        attempt = self.attempt.get(aid, 0) + 1
        self.attempt[aid] = attempt
        self.running[aid] = qa
        if sandbox is not None:
            self.sandbox_of[aid] = sandbox
        return attempt

    def requeued(self, action_id: str) -> QueuedAction | None:
        """A dispatched action goes back to the waiting queue (its attempt count stays)."""
        self.sandbox_of.pop(action_id, None)
        return self.running.pop(action_id, None)

    def forget(self, action_id: str) -> QueuedAction | None:
        """A dispatched action is over (completed, given up, vanished, cancelled before it was
        sent): everything about it goes. Returns its queue entry if it was dispatched."""
        self.attempt.pop(action_id, None)
        self.sandbox_of.pop(action_id, None)
        self.meta.pop(action_id, None)
        return self.running.pop(action_id, None)
