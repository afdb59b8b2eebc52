"""One-call helpers: build the policy a scenario needs and run it."""

from __future__ import annotations

from scheduler.policies import get_policy
from scheduler.policies.base import Policy
from scheduler.sim.engine import Simulator
from scheduler.sim.results import SimResult
from scheduler.sim.scenarios import Scenario


def service_loads(scenario: Scenario) -> dict[str, float]:
    """Expected GPU-seconds (at one GPU) per reward service: its calls times the prior T1 of its
    kind. What an operator sizing a dedicated deployment knows from earlier rollout steps."""
    loads: dict[str, float] = {}
    for traj in scenario.trajectories:
        for step in traj.steps:
            a = step.action
            if a.target and a.target in scenario.model_mb:
                prior = scenario.priors.get(a.kind)
                loads[a.target] = loads.get(a.target, 0.0) + (prior.t1_s if prior else a.t1_s)
    return loads


def make_policy(name: str, scenario: Scenario, **params: object) -> Policy:
    """`get_policy(name)`, giving `dedicated-gpu` what sizing it needs from the scenario (its
    services, their model sizes and expected loads, a call's GPU memory) when not set."""
    if name == "dedicated-gpu":
        params.setdefault("services", sorted(scenario.model_mb))
        params.setdefault("model_mb", dict(scenario.model_mb))
        params.setdefault("call_memory_mb", scenario.exec_params.gpu_activation_mb)
        if params.get("replicas") == "load":
            params.setdefault("loads", service_loads(scenario))
    return get_policy(name, **params)


def simulate(scenario: Scenario, policy: str | Policy, learn: bool = True) -> SimResult:
    """Run `scenario` under `policy` (a name or an instance) and return the result."""
    pol = make_policy(policy, scenario) if isinstance(policy, str) else policy
    return Simulator(scenario, pol, learn=learn).run()
