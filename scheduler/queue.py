"""The FCFS waiting queue, indexed by where its actions will run.

Algorithm 2 estimates, per pool, the completion of every queued action that is not a candidate
this round: `policies.common.distribute_rest` assigns them to pools, CPU actions to the node
their trajectory is pinned to. Over a plain list that is a walk over the whole queue every
elastic round, although only the actions pinned to the one or two nodes with free cores
matter: with thousands waiting on 25 nodes it was a third of a simulated round.

A `WaitingQueue` is a `Sequence[QueuedAction]` (policies iterate and slice it like a list) that
also keeps its actions routed: CPU actions per pinned node, unpinned CPU actions, GPU actions,
each in FCFS order. Routing is brought up to date lazily by `routes(state)`: new actions are
routed, unpinned ones whose trajectory got pinned since are moved (looked for only when a
trajectory the state logged as pinned, `ClusterState.pin_log`, has actions queued, or when the
count of pins shows pins set without the log: a burst of new trajectories is not walked each
round). The index is rebuilt from
scratch when the state's pins were replaced (`ClusterState.pin_epoch`) or a trajectory with
queued actions lost its pin (`ClusterState.unpin_log`; closing a trajectory with nothing queued,
the usual case, costs nothing). Pins change only in those ways (a pin is never overwritten in
place), so stale routing cannot change what a policy computes: `distribute_rest` gives the same
pools over a `WaitingQueue` as over a list of the same actions
(tests/unit/test_waiting_queue.py). It also keeps the actions that need no sandbox memory
(GPU, API, CPU without a sandbox) apart: with the pinned ones, all that can start once memory
is full (`behind_full_memory`).

    q = WaitingQueue()
    q.append(action)              # FCFS: appended at the tail
    policy.decide(q, state, now)  # any policy; the elastic ones use the index
    q.pop(action_id)              # started
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from scheduler.model import QueuedAction, ResourceKind
from scheduler.resources import ClusterState


@dataclass(slots=True)
class Routes:
    """Where the queued actions will run, each group in FCFS order (action id -> action)."""

    key: tuple[int, int, int]  # (id(state), id(state.trajectory_node), state.pin_epoch)
    pins: dict[str, str]  # held, so that its id cannot be reused by another dict
    on_node: dict[str, dict[str, QueuedAction]] = field(default_factory=dict)
    unpinned: dict[str, QueuedAction] = field(default_factory=dict)
    gpu: dict[str, QueuedAction] = field(default_factory=dict)
    new: dict[str, QueuedAction] = field(default_factory=dict)  # not routed yet
    log_seen: int = 0  # how much of the state's unpin log has been looked at
    pins_seen: int = 0  # how much of the state's pin log has been looked at
    pins_len: int = 0  # how many pins the state had then
    where: dict[str, str] = field(default_factory=dict)  # action routed to a node -> the node


class WaitingQueue(Sequence[QueuedAction]):
    """FCFS queue of waiting actions with an index of where they will run (see module doc)."""

    def __init__(self, actions: Iterable[QueuedAction] = ()) -> None:
        self._items: dict[str, QueuedAction] = {}
        self._seq: dict[str, int] = {}
        self._per_trajectory: dict[str, int] = {}  # trajectory -> actions queued
        self._per_job: dict[str, int] = {}  # job -> actions queued (fair share needs > 1 job)
        self._rigid: dict[str, QueuedAction] = {}  # rigid CPU actions, FCFS (time sharing)
        # actions that are not CPU actions with a sandbox (GPU, API, CPU without one), FCFS:
        # with the pinned ones, all that may start once memory is full (`behind_full_memory`)
        self._unsandboxed: dict[str, QueuedAction] = {}
        self._next = 0
        self._list: list[QueuedAction] | None = None  # positional view, rebuilt when asked
        self._routes: Routes | None = None
        # What policies derive from a queued action and keep across rounds (they check it is
        # still valid when they read it); an entry goes when its action leaves the queue.
        self.memo: dict[str, Any] = {}
        for action in actions:
            self.append(action)

    # ---- the queue ----------------------------------------------------------------------------
    def append(self, action: QueuedAction) -> None:
        """Queue `action` at the tail; an id already queued is a ValueError (nothing changes)."""
        aid = action.action_id
        if aid in self._items:
            raise ValueError(f"action {aid!r} is already queued")
        self._items[aid] = action
        self._seq[aid] = self._next
        self._next += 1
        tid = action.trajectory_id
        self._per_trajectory[tid] = self._per_trajectory.get(tid, 0) + 1
        self._per_job[action.job_id] = self._per_job.get(action.job_id, 0) + 1
        if action.cost.key is ResourceKind.CPU and len(action.cost.units.units) == 1:
            self._rigid[aid] = action
        if action.cost.key is not ResourceKind.CPU or not action.cost.sandbox:
            self._unsandboxed[aid] = action
        self._list = None
        if self._routes is not None:
            self._routes.new[aid] = action

    def pop(self, action_id: str) -> QueuedAction:
        """Remove and return a queued action (KeyError if it is not queued)."""
        action = self._items.pop(action_id)
        del self._seq[action_id]
        self._rigid.pop(action_id, None)
        self._unsandboxed.pop(action_id, None)
        self.memo.pop(action_id, None)
        self._list = None
        tid = action.trajectory_id
        left = self._per_trajectory[tid] - 1
        if left:
            self._per_trajectory[tid] = left
        else:
            del self._per_trajectory[tid]
        job = action.job_id
        left = self._per_job[job] - 1
        if left:
            self._per_job[job] = left
        else:
            del self._per_job[job]
        r = self._routes
        if r is not None and r.new.pop(action_id, None) is None:
            node = r.where.pop(action_id, None)
            if node is not None:
                group = r.on_node[node]
                del group[action_id]
                if not group:
                    del r.on_node[node]
            elif r.unpinned.pop(action_id, None) is None:
                r.gpu.pop(action_id, None)
        return action

    def sort_by_submission(self) -> None:
        """Reorder by submission time, ties in queue order (a stable sort): actions put back
        after a failure or a restart regain their FCFS place."""
        ordered = sorted(self._items.values(), key=lambda a: a.submitted_s)
        self._items = {a.action_id: a for a in ordered}
        self._rigid = {a.action_id: a for a in ordered if a.action_id in self._rigid}
        self._unsandboxed = {a.action_id: a for a in ordered if a.action_id in self._unsandboxed}
        self._seq = {a.action_id: i for i, a in enumerate(ordered)}
        self._next = len(ordered)
        self._list = None
        self._routes = None

    def get(self, action_id: str) -> QueuedAction | None:
        return self._items.get(action_id)

    def action(self, action_id: str) -> QueuedAction:
        """The queued action `action_id` (KeyError if it is not queued)."""
        return self._items[action_id]

    def values(self) -> Iterable[QueuedAction]:
        return self._items.values()

    def unsandboxed(self) -> Iterable[QueuedAction]:
        """The queued GPU and API actions and CPU actions without a sandbox, in FCFS order (a
        live view): what a round scans for GPU calls without reading every CPU action."""
        return self._unsandboxed.values()

    def rigid_cpu(self) -> Iterable[QueuedAction]:
        """The queued CPU actions with one unit count, in FCFS order (a live view): who may
        time-share held cores (`scheduler.policies.time_share`)."""
        return self._rigid.values()

    def behind_full_memory(self, state: ClusterState, after: str) -> Iterator[QueuedAction]:
        """The queued actions behind `after` (a queued action's id), FCFS, that do not need
        memory for a new sandbox: CPU actions of trajectories pinned in `state` (their memory
        is held on their node) and actions without a sandbox (GPU, API, CPU without one).
        Once a round found no memory for a new trajectory, nothing else behind it can start
        (`policies.tangram_fast`): this lets it go on over these instead of walking every new
        trajectory of a burst, each round."""
        routes = self.routes(state)
        seq = self._seq
        start = seq[after]
        lists: list[Iterable[QueuedAction]] = [group.values() for group in routes.on_node.values()]
        lists.append(self._unsandboxed.values())
        last: QueuedAction | None = None
        for a in heapq.merge(*lists, key=lambda a: seq[a.action_id]):
            if a is not last and seq[a.action_id] > start:  # pinned and unsandboxed: once
                yield a
            last = a

    def queued_of(self, trajectory_id: str) -> int:
        """How many actions of `trajectory_id` are queued."""
        return self._per_trajectory.get(trajectory_id, 0)

    def trajectories(self) -> Collection[str]:
        """The trajectories with at least one queued action (a live view)."""
        return self._per_trajectory.keys()

    def jobs(self) -> Collection[str]:
        """The jobs with at least one queued action (a live view)."""
        return self._per_job.keys()

    def position(self, action_id: str) -> int:
        """A number that orders queued actions FCFS (not the index in the sequence)."""
        return self._seq[action_id]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[QueuedAction]:
        return iter(self._items.values())

    def __contains__(self, item: object) -> bool:
        if isinstance(item, QueuedAction):
            return self._items.get(item.action_id) is item
        return item in self._items

    @overload
    def __getitem__(self, i: int) -> QueuedAction: ...
    @overload
    def __getitem__(self, i: slice) -> list[QueuedAction]: ...
    def __getitem__(self, i: int | slice) -> QueuedAction | list[QueuedAction]:
        if self._list is None:
            self._list = list(self._items.values())
        return self._list[i]

    def __repr__(self) -> str:
        return f"WaitingQueue({len(self)} actions)"

    # ---- the index ----------------------------------------------------------------------------
    def routes(self, state: ClusterState) -> Routes:
        """The index, brought up to date with `state`'s pins."""
        pins = state.trajectory_node
        key = (id(state), id(pins), state.pin_epoch)
        r = self._routes
        logged = state.unpin_base + len(state.unpin_log)
        if r is not None and r.key == key and r.log_seen != logged:
            # unpinned trajectories with actions still queued would have to move: start over
            start = r.log_seen - state.unpin_base
            if start < 0 or any(t in self._per_trajectory for t in state.unpin_log[start:]):
                r = None
        if r is None or r.key != key:
            r = self._routes = Routes(key, pins, new=dict(self._items))
        elif r.unpinned and self._pinned_since(r, state, logged):
            moved = [a for a in r.unpinned.values() if a.trajectory_id in pins]
            for a in moved:
                del r.unpinned[a.action_id]
                self._place(r, a, pins[a.trajectory_id])
        r.log_seen = logged
        r.pins_seen, r.pins_len = state.pin_base + len(state.pin_log), len(pins)
        if r.new:
            cpu, gpu = ResourceKind.CPU, ResourceKind.GPU
            for aid, a in r.new.items():
                kind = a.cost.key
                if kind is cpu:
                    node = pins.get(a.trajectory_id)
                    if node is None:
                        r.unpinned[aid] = a
                    else:
                        self._place(r, a, node)
                elif kind is gpu:
                    r.gpu[aid] = a
                # API actions do not compete for elastic units: not indexed
            r.new.clear()
        return r

    def _pinned_since(self, r: Routes, state: ClusterState, unpins: int) -> bool:
        """Whether a trajectory with actions queued may have been pinned since `r` was brought
        up to date: one of those the state logged, or any when the count of pins tells of pins
        added without the log (or the log dropped entries not yet looked at). The walk over the
        unpinned actions it saves was a round's cost in a burst of new trajectories."""
        start = r.pins_seen - state.pin_base
        added = state.pin_base + len(state.pin_log) - r.pins_seen
        if start < 0 or len(state.trajectory_node) != r.pins_len + added - (unpins - r.log_seen):
            return True
        per = self._per_trajectory
        return any(t in per for t in state.pin_log[start:])

    def _place(self, r: Routes, action: QueuedAction, node: str) -> None:
        """Route a CPU action to `node`, keeping the node's actions in FCFS order."""
        aid = action.action_id
        r.where[aid] = node
        group = r.on_node.get(node)
        if group is None:
            r.on_node[node] = {aid: action}
            return
        seq = self._seq
        if seq[next(reversed(group))] < seq[aid]:
            group[aid] = action
            return
        group[aid] = action  # an older action whose trajectory got pinned after newer ones came
        r.on_node[node] = dict(sorted(group.items(), key=lambda kv: seq[kv[0]]))


def merge_fcfs(
    queue: WaitingQueue, a: Sequence[QueuedAction], b: Sequence[QueuedAction]
) -> list[QueuedAction]:
    """Two FCFS-ordered lists of actions of `queue` as one, FCFS."""
    if not a:
        return list(b)
    if not b:
        return list(a)
    seq = queue.position
    return sorted([*a, *b], key=lambda x: seq(x.action_id))
