"""The live scheduler: consumes the intake, runs the scheduling round, dispatches to per-resource
queues.

This is the only part of `scheduler/` that does I/O; it wraps the round (`scheduler.round`, the
simulator's round too) in a control loop (snapshot -> round -> executor). Modules, bottom up:
`cluster` (the state and costs from the config), `liveness` and `recovery` (pure plans),
`books` (the action book), `sender` (every Celery message), `sandboxes` and `trajectories` (the
trajectory book), `warmer` (the GPU warmer), `faults`, `intake`, `events`, `dispatch` (handlers
that act on the books), `loop` (the service, which owns them and applies them in order).
Modules here import their siblings, never this package.
"""

from scheduler.service.loop import SchedulerService

__all__ = ["SchedulerService"]
