"""The live scheduler: consumes the intake, asks the policy, dispatches to per-resource queues.

This is the only part of `scheduler/` that does I/O; it wraps the pure policy in a control loop
(snapshot -> policy -> executor), so the simulator and this service run the same policy code.
"""

from scheduler.service.loop import SchedulerService

__all__ = ["SchedulerService"]
