"""Scheduling policies, chosen by name from a registry.

A policy is a pure function of (queue in FCFS order, cluster state, now) -> allocations. It does
no I/O and does not mutate the state it is given; the caller applies the allocations in order.

Each policy declares how its decisions are executed, as an `ExecutionModel` (its `execution`
attribute, `scheduler.execution`): the baselines' pods time-share cores, their GPU services are
dedicated or loaded per call, their API calls are not held back. The simulator executes every
model; the live service only Tangram's own (`live_policies()` lists the policies it accepts).
"""

from scheduler.policies.base import Policy, available, get_policy, live_policies, register
from scheduler.policies.cold_start import ColdStart
from scheduler.policies.dedicated_gpu import DedicatedGpu
from scheduler.policies.fcfs_min import FcfsMin
from scheduler.policies.fixed_dop import FixedDop
from scheduler.policies.per_trajectory_api import PerTrajectoryApi
from scheduler.policies.static_pod import AllAtOnce, StaticPod
from scheduler.policies.tangram_dp import TangramDp
from scheduler.policies.tangram_fast import TangramFast

__all__ = [
    "AllAtOnce",
    "ColdStart",
    "DedicatedGpu",
    "FcfsMin",
    "FixedDop",
    "PerTrajectoryApi",
    "Policy",
    "StaticPod",
    "TangramDp",
    "TangramFast",
    "available",
    "get_policy",
    "live_policies",
    "register",
]
