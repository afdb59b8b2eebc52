"""Scheduling policies, chosen by name from a registry.

A policy is a pure function of (queue in FCFS order, cluster state, now) -> allocations. It does
no I/O and does not mutate the state it is given; the caller applies the allocations in order.
"""

from scheduler.policies.base import Policy, available, get_policy, register
from scheduler.policies.fcfs_min import FcfsMin

__all__ = ["FcfsMin", "Policy", "available", "get_policy", "register"]
