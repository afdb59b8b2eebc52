"""`fixed-dop-K`: FCFS like `fcfs-min`, but every elastic action runs at a fixed DoP K.

The paper's ablation baseline (fixed DoP 4 and 16 against elastic 1-32). The DoP is the
largest allowed unit count <= K (the minimum when none is).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.execution import TANGRAM
from scheduler.model import Allocation, QueuedAction
from scheduler.policies.base import register
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.resources import ClusterState


def fixed_units(action: QueuedAction, dop: int) -> int:
    """The unit count a fixed-DoP-`dop` system gives `action`."""
    allowed = [u for u in action.cost.units.units if u <= dop]
    return allowed[-1] if allowed else action.cost.units.min


@register("fixed-dop")
class FixedDop:
    """Every action at `fixed_units(action, dop)`; selectable as "fixed-dop-4", "fixed-dop-16"."""

    execution = TANGRAM

    def __init__(self, dop: int = 4) -> None:
        if dop < 1:
            raise ValueError(f"fixed DoP must be >= 1, got {dop}")
        self.dop = dop
        self.name = f"fixed-dop-{dop}"

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        return fcfs_prefix(queue, state, now_s, lambda a: fixed_units(a, self.dop))[0]
