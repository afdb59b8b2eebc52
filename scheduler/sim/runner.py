"""One-call helpers: build the policy a scenario needs and run it."""

from __future__ import annotations

from scheduler.policies import get_policy
from scheduler.policies.base import Policy
from scheduler.sim.engine import Simulator
from scheduler.sim.results import SimResult
from scheduler.sim.scenarios import Scenario


def make_policy(name: str, scenario: Scenario, **params: object) -> Policy:
    """`get_policy(name)`, giving `dedicated-gpu` the scenario's services when none are set."""
    if name == "dedicated-gpu" and "services" not in params:
        params["services"] = sorted(scenario.model_mb)
    return get_policy(name, **params)


def simulate(scenario: Scenario, policy: str | Policy, learn: bool = True) -> SimResult:
    """Run `scenario` under `policy` (a name or an instance) and return the result."""
    pol = make_policy(policy, scenario) if isinstance(policy, str) else policy
    return Simulator(scenario, pol, learn=learn).run()
