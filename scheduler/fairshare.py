"""Priorities and fair share across training jobs that share the pools (the paper is FCFS only).

`order_queue` is pure: it reorders the waiting queue so that
1. within a job, order stays FCFS (starving one action stalls its whole trajectory);
2. across jobs, the job with the highest effective priority goes first, where the effective
   priority of a job is its head action's `priority` plus its waiting time / `aging_s` (so a
   low-priority job is never starved: it gains one priority level per `aging_s` waited);
3. among jobs of equal effective priority, the one with the smallest weighted share, i.e.
   (units it holds + units of its actions already placed in the order) / weight, goes next.

With a single job and equal priorities the order is exactly FCFS. The scheduling round
(`scheduler.round.Round`) hands the reordered queue to the policy, so the policy's FCFS prefix
becomes a fair prefix.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence

from scheduler.model import QueuedAction


def order_queue(
    queue: Sequence[QueuedAction],
    held_units: Mapping[str, int],
    weights: Mapping[str, float],
    now_s: float,
    aging_s: float = 60.0,
) -> list[QueuedAction]:
    """The waiting queue in fair order (see module doc). `held_units` = units in use per job."""
    per_job: dict[str, deque[QueuedAction]] = {}
    for a in queue:
        per_job.setdefault(a.job_id, deque()).append(a)
    if len(per_job) <= 1:
        return list(queue)  # one job: FCFS (priorities order jobs, not actions within a job)
    placed = {job: float(held_units.get(job, 0)) for job in per_job}
    out: list[QueuedAction] = []
    while per_job:
        best_job = ""
        best_key: tuple[float, float, float] | None = None
        for job, q in per_job.items():
            head = q[0]
            level = math.floor(head.priority + max(0.0, now_s - head.submitted_s) / aging_s)
            share = placed[job] / max(weights.get(job, 1.0), 1e-9)
            key = (-level, share, head.submitted_s)
            if best_key is None or key < best_key:
                best_job, best_key = job, key
        q = per_job[best_job]
        action = q.popleft()
        out.append(action)
        placed[best_job] += action.cost.units.min
        if not q:
            del per_job[best_job]
    return out
