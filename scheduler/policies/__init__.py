"""Scheduling policies, chosen by name from a registry.

A policy is a pure function of (queue in FCFS order, cluster state, now) -> allocations. It does
no I/O and does not mutate the state it is given; the caller applies the allocations in order.

Optional class attributes tell an executor (the simulator, or a live worker) how the baseline
systems *execute* what they decide: `cpu_sharing` (static pods time-share cores),
`gpu_residency` ("cache" default, "dedicated", "none") and `api_control` (False: no quota
control, the provider rejects over-limit calls).
"""

from scheduler.policies.base import Policy, available, get_policy, register
from scheduler.policies.cold_start import ColdStart
from scheduler.policies.dedicated_gpu import DedicatedGpu
from scheduler.policies.fcfs_min import FcfsMin
from scheduler.policies.fixed_dop import FixedDop
from scheduler.policies.per_trajectory_api import PerTrajectoryApi
from scheduler.policies.static_pod import StaticPod
from scheduler.policies.tangram_dp import TangramDp
from scheduler.policies.tangram_fast import TangramFast

__all__ = [
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
    "register",
]
