"""Duration model: dur(m) = T1 / (E(m) * m), with 0 < E(m) <= 1.

Curves are small value objects; they must be cheap to evaluate because policies call them in
their inner loops.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol


class ElasticityCurve(Protocol):
    def efficiency(self, units: int) -> float:
        """Parallel efficiency E(m) in (0, 1] at m units."""
        ...


@dataclass(frozen=True, slots=True)
class Rigid:
    """No speed-up from more units: E(m) = 1/m, so dur(m) = T1."""

    def efficiency(self, units: int) -> float:
        return 1.0 / units


@dataclass(frozen=True, slots=True)
class Amdahl:
    """Amdahl's law with parallel fraction `p`: speedup(m) = 1 / ((1-p) + p/m)."""

    p: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"parallel fraction must be in [0, 1], got {self.p}")

    def efficiency(self, units: int) -> float:
        return 1.0 / (((1.0 - self.p) + self.p / units) * units)


@dataclass(frozen=True, slots=True)
class Table:
    """Profiled speed-ups as {m: E(m)} points, ascending in m.

    Between profiled points the speed-up E(m)*m is interpolated linearly; past the last point
    the last speed-up is held (more units buy nothing that was not measured).
    """

    points: tuple[tuple[int, float], ...]

    def efficiency(self, units: int) -> float:
        pts = self.points
        if units <= pts[0][0]:
            return min(1.0, pts[0][1] * pts[0][0] / units)
        for (m0, e0), (m1, e1) in itertools.pairwise(pts):
            if m0 <= units <= m1:
                s0, s1 = e0 * m0, e1 * m1
                speedup = s0 + (s1 - s0) * (units - m0) / (m1 - m0)
                return min(1.0, speedup / units)
        m_last, e_last = pts[-1]
        return min(1.0, e_last * m_last / units)
