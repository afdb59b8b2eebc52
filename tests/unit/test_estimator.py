"""DurationEstimator: prior, online running mean, Amdahl fit, persistence."""

from __future__ import annotations

import pytest

from scheduler.estimator import DurationEstimator, Prior
from scheduler.model import CostVector, Elastic, QueuedAction, ResourceKind


def test_prior_is_used_before_any_observation() -> None:
    """Given a prior, when nothing was observed, then the estimate is the prior."""
    est = DurationEstimator(priors={"tests": Prior(100.0, 0.9)})
    t1_s, curve = est.estimate("tests")
    assert t1_s == pytest.approx(100.0)
    assert curve.p == pytest.approx(0.9)


def test_observations_at_one_unit_pull_t1_towards_the_measurements() -> None:
    """Given a 10 s prior, when 50 runs of 20 s are observed, then T1 approaches 20 s."""
    est = DurationEstimator(priors={"shell": Prior(10.0)})
    for _ in range(50):
        est.observe("shell", 1, 20.0)
    assert est.estimate("shell")[0] == pytest.approx(20.0, rel=0.15)


def test_amdahl_fraction_is_fitted_from_two_unit_counts() -> None:
    """Given runs at 1 and 8 units from p=0.8, T1=50, when fitted, then T1 and p are recovered."""
    est = DurationEstimator(priors={"run": Prior(10.0, 0.0)}, prior_weight=0.01)
    for _ in range(40):
        est.observe("run", 1, 50.0)
        est.observe("run", 8, 50.0 * (0.2 + 0.8 / 8))
    t1_s, curve = est.estimate("run")
    assert t1_s == pytest.approx(50.0, rel=0.05)
    assert curve.p == pytest.approx(0.8, abs=0.05)


def test_annotate_sets_duration_model_and_roundtrip_keeps_state() -> None:
    """Given observations, when saved and loaded, then annotate gives the same durations."""
    est = DurationEstimator(priors={"tests": Prior(100.0, 0.9)})
    est.observe("tests", 4, 40.0)
    again = DurationEstimator.from_dict(est.to_dict())
    a = QueuedAction("a", "t", CostVector(ResourceKind.CPU, Elastic.range(1, 8)), 0.0, kind="tests")
    b = QueuedAction("b", "t", CostVector(ResourceKind.CPU, Elastic.range(1, 8)), 0.0, kind="tests")
    est.annotate(a)
    again.annotate(b)
    assert a.duration_s(4) == pytest.approx(b.duration_s(4))
    assert a.duration_s(8) < a.duration_s(1)


def test_samples_arriving_shortest_first_do_not_bias_the_mean() -> None:
    """Given one step's lognormal durations (mean 300 s) completing shortest first, as a rollout
    step's actions do, when observed, then T1 is their mean, not the last (longest) samples'."""
    import random

    rng = random.Random(5)
    durations = sorted(rng.lognormvariate(0.0, 0.8) for _ in range(150))
    scale = 300.0 / (sum(durations) / len(durations))
    est = DurationEstimator(priors={"tests": Prior(300.0)})
    for d in durations:
        est.observe("tests", 1, d * scale)
    assert est.estimate("tests")[0] == pytest.approx(300.0, rel=0.03)


def test_the_running_mean_follows_drift_once_the_window_is_full() -> None:
    """Given 1000 runs of 10 s and then 1000 of 20 s, when observed, then T1 is near 20 s (the
    10 s prior keeps a weight of 3 against 20 for the measurements)."""
    est = DurationEstimator(priors={"shell": Prior(10.0)})
    for d in [10.0] * 1000 + [20.0] * 1000:
        est.observe("shell", 1, d)
    assert est.estimate("shell")[0] == pytest.approx((3 * 10.0 + 20 * 20.0) / 23, rel=0.01)
