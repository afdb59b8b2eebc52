"""Online duration learning: T1 and an Amdahl parallel fraction per action kind.

The paper profiles T_ori offline ("historical averages"). We start from a prior per kind (from
the config) and learn from completed actions: a running mean of the measured execution time per
(kind, units), then a weighted least-squares fit of Amdahl's law

    dur(m) = T1 * ((1 - p) + p / m) = a + b / m,   a = T1 (1 - p),  b = T1 p

over the unit counts seen so far. The prior takes part in the fit as a pseudo-observation at
one unit (and, when elastic, at `prior_units_hi`), so a few noisy samples cannot swing it far.

The running mean is the plain mean of the first 1/alpha samples (200), then an EWMA with weight
`alpha`. A short window is biased: the actions of a rollout step complete shortest first, so at
the end of every step the last samples are the longest ones (with alpha = 0.2 the coding
scenario's test suites, true T1 300 s and p 0.97, were estimated at T1 1132 s, p 1.0; now
294 s, 0.957). Weighting points by relative error (samples / y^2) fits the final samples even
better but made both tangram policies' ACT much worse (fast 4.24 s -> 6.7 s on coding): early
in a step only the short, many-core runs have completed, and that fit trusts them.
Pure and cheap: no I/O; `to_dict` / `from_dict` for persistence by the live service.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.duration import Amdahl
from scheduler.model import QueuedAction


@dataclass(frozen=True, slots=True)
class Prior:
    """What is believed about a kind before any measurement: T1 in seconds, Amdahl p."""

    t1_s: float
    p: float = 0.0


@dataclass(slots=True)
class _Mean:
    mean_s: float
    count: int


@dataclass
class DurationEstimator:
    """Learns (T1, curve) per action kind from `observe` calls.

    `alpha` is the smallest weight of a new sample in a running mean (1/n before that);
    `prior_weight` is how many samples the prior is worth in the fit; `default` is used for
    kinds with neither prior nor samples.
    """

    priors: dict[str, Prior] = field(default_factory=dict)
    alpha: float = 0.005
    prior_weight: float = 3.0
    prior_units_hi: int = 8
    default: Prior = field(default_factory=lambda: Prior(t1_s=1.0, p=0.0))
    _stats: dict[str, dict[int, _Mean]] = field(default_factory=dict)
    _cache: dict[str, tuple[float, Amdahl]] = field(default_factory=dict)

    def observe(self, kind: str, units: int, exec_s: float) -> None:
        """Record that an action of `kind` ran `exec_s` seconds on `units` units."""
        if units < 1 or exec_s < 0:
            raise ValueError(f"bad observation units={units} exec_s={exec_s}")
        per_units = self._stats.setdefault(kind, {})
        st = per_units.get(units)
        if st is None:
            per_units[units] = _Mean(exec_s, 1)
        else:
            st.count += 1
            st.mean_s += max(self.alpha, 1.0 / st.count) * (exec_s - st.mean_s)
        self._cache.pop(kind, None)

    def observed_s(self, kind: str, units: int, min_samples: int = 5) -> float | None:
        """The running mean of what `kind` took at `units` units, once `min_samples` runs were
        measured (None before: only the prior is known). Unlike `estimate`, no prior weighs on
        it: for decisions that need what the actions are measured to take (which actions are
        short, `scheduler.policies.cpu_batch`), not a fit that resists a few noisy samples."""
        st = self._stats.get(kind, {}).get(units)
        return st.mean_s if st is not None and st.count >= min_samples else None

    def estimate(self, kind: str) -> tuple[float, Amdahl]:
        """(T1 in seconds, Amdahl curve) for `kind`: the prior refined by what was observed."""
        hit = self._cache.get(kind)
        if hit is None:
            hit = self._fit(kind)
            self._cache[kind] = hit
        return hit

    def annotate(self, action: QueuedAction) -> QueuedAction:
        """Set `action.t1_s` and `action.efficiency` from the current estimate (in place)."""
        t1_s, curve = self.estimate(action.kind)
        action.t1_s = t1_s
        action.efficiency = curve
        return action

    def _fit(self, kind: str) -> tuple[float, Amdahl]:
        prior = self.priors.get(kind, self.default)
        # Points (x = 1/m, y = dur, weight): prior pseudo-points plus means.
        pts: list[tuple[float, float, float]] = [(1.0, prior.t1_s, self.prior_weight)]
        if prior.p > 0.0:
            hi = self.prior_units_hi
            y_hi = prior.t1_s * ((1.0 - prior.p) + prior.p / hi)
            pts.append((1.0 / hi, y_hi, self.prior_weight))
        stats = self._stats.get(kind, {})
        for units, st in stats.items():
            pts.append((1.0 / units, st.mean_s, float(min(st.count, 20))))
        xs = {x for x, _, _ in pts}
        if len(xs) == 1:
            # Only one unit count seen: scale T1, keep the prior's p.
            wsum = sum(w for _, _, w in pts)
            y = sum(w * y for _, y, w in pts) / wsum
            m = 1.0 / pts[0][0]
            t1_s = y / ((1.0 - prior.p) + prior.p / m)
            return max(t1_s, 1e-6), Amdahl(prior.p)
        wsum = sum(w for _, _, w in pts)
        mx = sum(w * x for x, _, w in pts) / wsum
        my = sum(w * y for _, y, w in pts) / wsum
        sxx = sum(w * (x - mx) ** 2 for x, _, w in pts)
        sxy = sum(w * (x - mx) * (y - my) for x, y, w in pts)
        b = max(0.0, sxy / sxx) if sxx > 0 else 0.0
        a = max(0.0, my - b * mx)
        t1_s = a + b
        if t1_s <= 0.0:
            return max(my, 1e-6), Amdahl(0.0)
        return t1_s, Amdahl(min(1.0, b / t1_s))

    # ---- persistence -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "prior_weight": self.prior_weight,
            "prior_units_hi": self.prior_units_hi,
            "default": {"t1_s": self.default.t1_s, "p": self.default.p},
            "priors": {k: {"t1_s": v.t1_s, "p": v.p} for k, v in self.priors.items()},
            "stats": {
                k: {str(u): [s.mean_s, s.count] for u, s in per.items()} for k, per in self._stats.items()
            },
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DurationEstimator:
        est = cls(
            priors={k: Prior(float(v["t1_s"]), float(v["p"])) for k, v in d["priors"].items()},
            alpha=float(d["alpha"]),
            prior_weight=float(d["prior_weight"]),
            prior_units_hi=int(d.get("prior_units_hi", 8)),
            default=Prior(float(d["default"]["t1_s"]), float(d["default"]["p"])),
        )
        for kind, per in d.get("stats", {}).items():
            est._stats[kind] = {int(u): _Mean(float(m), int(c)) for u, (m, c) in per.items()}
        return est

    @classmethod
    def from_config(cls, priors: dict[str, dict[str, float]], **kw: Any) -> DurationEstimator:
        """Build from the config's priors, `{kind: {"t1_s": ..., "parallel_fraction": ...}}`
        (`scheduler.priors`; the parallel fraction is Amdahl's `p` here)."""
        return cls(
            priors={
                k: Prior(float(v["t1_s"]), float(v.get("parallel_fraction", 0.0))) for k, v in priors.items()
            },
            **kw,
        )
