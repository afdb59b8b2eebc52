"""The live scheduler: consumes the intake, runs the scheduling round, dispatches to per-resource
queues.

This is the only part of `scheduler/` that does I/O; it wraps the round (`scheduler.round`, the
simulator's round too) in a control loop (snapshot -> round -> executor). Modules, bottom up:
`books` (bookkeeping), `context` (what the parts share, the Celery sender), `liveness` and
`recovery` (pure plans), `trajectories`, `intake`, `events`, `faults`, `dispatch` (functions of
a context), `loop` (the service, which applies them in order).
"""

from scheduler.service.loop import SchedulerService

__all__ = ["SchedulerService"]
