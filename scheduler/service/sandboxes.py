"""What the scheduler knows of the trajectories' sandboxes, beyond pins and reservations.

`ClusterState` says where a trajectory is pinned and how much memory it holds; this says which
sandbox that is, so that a worker can tell a stale sandbox from the current one, and whether
the trajectory's next action runs in a fresh sandbox although the caller may rely on files:

- **generation**: each time a trajectory is pinned (its first action, or the first after its
  sandbox was evicted or lost) the sandbox gets a new generation, the id of the pinning
  action. The worker keeps it with the sandbox: an action of a newer generation replaces an
  older sandbox it finds (a close message that arrives late cannot remove the new one, since
  a close names its generation).
- **owner**: the worker incarnation (process) that ran the trajectory's last action and its
  completion counter then. Workers report the sandboxes they hold (`tangram:sandboxes`, next
  to their heartbeats), so the scheduler can tell which idle trajectories lost their sandbox:
  the owner died or restarted (a restarted worker holds none), or its report, newer than that
  completion, no longer lists it (`gone`).
- **reset**: trajectories whose sandbox was evicted, expired or lost while the caller may still
  use them. The next action that pins one again runs in a fresh sandbox and its result has
  `sandbox_reset: true`. Kept in Redis (`tangram:reset`) for a day.

One-shot actions (no trajectory, or `ephemeral`) get a key of their own, `~<action id>`, which
is released as soon as the action completes and is never reported reset.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tangram_celery.common.records import PinRecord, SandboxReport
from tangram_celery.common.wire import SandboxOrder

ONE_SHOT = "~"  # prefix of the scheduler's key for a one-shot action (not a valid trajectory id)
RESET_TTL_S = 24 * 3600.0
# Resets remembered at most (the oldest are forgotten first). A stateless caller never comes
# back to its evicted trajectories: at 100 of them a second a day of resets would be millions
# of entries, walked every second and held in Redis. A trajectory forgotten here that does come
# back runs in a fresh sandbox without `sandbox_reset`.
RESET_MAX = 100_000


def one_shot_key(action_id: str) -> str:
    return ONE_SHOT + action_id


def is_one_shot(trajectory_id: str) -> bool:
    return trajectory_id.startswith(ONE_SHOT)


def caller_trajectory(trajectory_id: str) -> str:
    """The trajectory id a caller knows (empty for a one-shot action)."""
    return "" if is_one_shot(trajectory_id) else trajectory_id


@dataclass
class SandboxBook:
    """Generations, owners and pending resets of the pinned trajectories (see module doc)."""

    gen: dict[str, str] = field(default_factory=dict)
    owner: dict[str, tuple[str, int]] = field(default_factory=dict)
    reset: dict[str, float] = field(default_factory=dict)  # trajectory -> when it lost its sandbox
    why: dict[str, str] = field(default_factory=dict)  # trajectory -> why, when told (not persisted)

    def pinned(self, tid: str, action_id: str) -> SandboxOrder:
        """A CPU action pins `tid` (a new sandbox): the worker's sandbox instructions."""
        self.gen[tid] = action_id
        self.owner.pop(tid, None)
        reset = self.reset.pop(tid, None) is not None
        why = self.why.pop(tid, None)
        return SandboxOrder(gen=action_id, new=True, reset=reset, why=why if reset else None)

    def reuse(self, tid: str, action_id: str) -> SandboxOrder:
        """A CPU action of pinned `tid`: run in its existing sandbox (the pinning action placed
        again, after a retryable failure, may still find none)."""
        gen = self.gen.get(tid, "")
        return SandboxOrder(gen=gen, new=gen == action_id)

    def completed(self, tid: str, worker: str, seq: int) -> bool:
        """The trajectory's action completed on `worker` at its completion counter `seq`; True
        if the owner changed (the pin record is worth rewriting)."""
        if not worker or tid not in self.gen:
            return False
        old = self.owner.get(tid)
        self.owner[tid] = (worker, seq)
        return old is None or old[0] != worker

    def lost(self, tid: str, now_s: float, why: str | None = None) -> None:
        """The trajectory's sandbox is gone while its caller may go on (evicted, expired, its
        worker or node lost, drained): its next action reports a reset (and `why`, if told)."""
        if tid in self.gen and not is_one_shot(tid):
            self.note_reset(tid, now_s)
            if why:
                self.why[tid] = why
        self.gen.pop(tid, None)
        self.owner.pop(tid, None)

    def closed(self, tid: str) -> None:
        """The caller closed the trajectory (or it was a one-shot action): forget it all."""
        self.gen.pop(tid, None)
        self.owner.pop(tid, None)
        self.reset.pop(tid, None)
        self.why.pop(tid, None)

    def note_reset(self, tid: str, at_s: float) -> None:
        """`tid`'s next action reports a reset (`reset` stays in the order of these times)."""
        self.reset.pop(tid, None)
        self.reset[tid] = at_s
        self.why.pop(tid, None)

    def restore_resets(self, resets: Mapping[str, float]) -> None:
        for tid, at_s in sorted(resets.items(), key=lambda kv: kv[1]):
            self.note_reset(tid, at_s)

    def expire_resets(self, now_s: float) -> list[str]:
        """Forget resets older than a day (their trajectories are not coming back) and the
        oldest beyond `RESET_MAX`; returns them. Walks only what it forgets (oldest first)."""
        old: list[str] = []
        excess = len(self.reset) - RESET_MAX
        for t, at in self.reset.items():
            if now_s - at <= RESET_TTL_S and len(old) >= excess:
                break
            old.append(t)
        for t in old:
            del self.reset[t]
            self.why.pop(t, None)
        return old

    def gone(
        self, idle: Iterable[str], alive: set[str], reports: Mapping[str, SandboxReport]
    ) -> tuple[list[str], list[str]]:
        """Of the idle pinned trajectories `idle`, those whose sandbox no longer exists:
        (lost ones, which had a sandbox, and never-started ones, whose pinning action never
        completed in a worker, e.g. it was given up).

        A sandbox is gone when its owner is not among the `alive` workers (dead, or restarted
        under a new incarnation), or the owner's report, taken after the trajectory's last
        completion there, does not list it (with its generation).
        """
        lost: list[str] = []
        never: list[str] = []
        held: dict[str, dict[str, str]] = {}  # worker -> its report's trajectory -> generation
        for tid in idle:
            owner = self.owner.get(tid)
            if owner is None:
                never.append(tid)
                continue
            worker, seq = owner
            if worker not in alive:
                lost.append(tid)
                continue
            rep = reports.get(worker)
            if rep is None or rep.seq < seq:
                continue
            if worker not in held:
                held[worker] = rep.generations()
            if held[worker].get(tid) != self.gen.get(tid):
                lost.append(tid)
        return lost, never

    # ---- persistence (the pin records of `tangram:traj`, and `tangram:reset`) --------------------
    def pin_record(self, tid: str, node: str, memory_mb: int) -> PinRecord:
        """`tid`'s pin record: its node and reservation, with its sandbox's generation and owner."""
        return PinRecord(node=node, memory_mb=memory_mb, gen=self.gen.get(tid, ""), owner=self.owner.get(tid))

    def restore_pin(self, tid: str, pin: PinRecord) -> None:
        if pin.gen:
            self.gen[tid] = pin.gen
        if pin.owner is not None:
            self.owner[tid] = pin.owner
