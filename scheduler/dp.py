"""DPArrange (the paper's Algorithms 3 and 4): optimal discrete unit choice for candidates.

Given candidates `1..n`, each with a list of `(units, duration_s)` options, and a pool whose free
units are described by a pluggable *operator*, find the choice that minimises the sum of the
candidates' durations while every candidate gets one option and the pool is not overdrawn.

    dp[i][s] = min total duration of candidates 1..i leaving the pool in state s

The paper writes the recurrence backwards with `Prev(state, k)`; we run the same recurrence
forwards with `take(state, k)` (the state after taking k units, or None when invalid), which is
the same DP over the same reachable states.

Operators:
- `CpuCores(free)`: state = cores used so far in one NUMA group (`take(j, k) = j + k`).
- `GpuBuddy(counts)`: state = free buddy chunks per size (1, 2, 4, 8), as in HiveD; taking k
  GPUs uses a free k-chunk or splits the smallest larger one (k, 2k, ... stay free).

`cpu_arrange` is a numpy specialisation of the CPU case with identical results.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from scheduler.resources import GPU_CHUNK_SIZES

Option = tuple[int, float]  # (units, duration_s)


class Operator(Protocol):
    """The pool's state space for DPArrange."""

    def start(self) -> Hashable:
        """The state before any candidate takes units."""
        ...

    def take(self, state: Hashable, units: int) -> Hashable | None:
        """The state after taking `units` from `state`, or None if that is not possible."""
        ...


@dataclass(frozen=True, slots=True)
class CpuCores:
    """`free` interchangeable cores (one NUMA group)."""

    free: int

    def start(self) -> Hashable:
        return 0

    def take(self, state: Hashable, units: int) -> Hashable | None:
        assert isinstance(state, int)
        used = state + units
        return used if used <= self.free else None


@dataclass(frozen=True, slots=True)
class GpuBuddy:
    """Free buddy chunks, `counts[size]` for size in 1/2/4/8 (as `GpuNode.free_chunk_counts`)."""

    counts: tuple[int, int, int, int]

    @classmethod
    def from_counts(cls, counts: dict[int, int]) -> GpuBuddy:
        c = tuple(counts.get(s, 0) for s in GPU_CHUNK_SIZES)
        return cls((c[0], c[1], c[2], c[3]))

    def start(self) -> Hashable:
        return self.counts

    def take(self, state: Hashable, units: int) -> Hashable | None:
        assert isinstance(state, tuple)
        if units not in GPU_CHUNK_SIZES:
            return None
        idx = GPU_CHUNK_SIZES.index(units)
        counts = list(state)
        if counts[idx] > 0:
            counts[idx] -= 1
            return tuple(counts)
        for j in range(idx + 1, len(GPU_CHUNK_SIZES)):
            if counts[j] > 0:
                counts[j] -= 1
                # Splitting a 2^j chunk to serve 2^idx leaves one free chunk of each size between.
                for t in range(idx, j):
                    counts[t] += 1
                return tuple(counts)
        return None


def arrange(op: Operator, options: Sequence[Sequence[Option]]) -> tuple[float, list[int]] | None:
    """Optimal choice: (sum of durations in s, units per candidate), or None when infeasible."""
    layer: dict[Hashable, float] = {op.start(): 0.0}
    back: list[dict[Hashable, tuple[Hashable, int]]] = []
    for opts in options:
        nxt: dict[Hashable, float] = {}
        ptr: dict[Hashable, tuple[Hashable, int]] = {}
        for state, cost in layer.items():
            for units, dur_s in opts:
                s2 = op.take(state, units)
                if s2 is None:
                    continue
                c2 = cost + dur_s
                if c2 < nxt.get(s2, float("inf")):
                    nxt[s2] = c2
                    ptr[s2] = (state, units)
        if not nxt:
            return None
        layer = nxt
        back.append(ptr)
    best_state = min(layer, key=lambda s: layer[s])
    total = layer[best_state]
    choice: list[int] = []
    state = best_state
    for ptr in reversed(back):
        state, units = ptr[state]
        choice.append(units)
    choice.reverse()
    return total, choice


def cpu_arrange(free_cores: int, options: Sequence[Sequence[Option]]) -> tuple[float, list[int]] | None:
    """`arrange(CpuCores(free_cores), options)` with numpy: O(n * m) vector ops of length R."""
    size = free_cores + 1
    inf = np.inf
    dp = np.full(size, inf)
    dp[0] = 0.0
    picks: list[np.ndarray] = []
    for opts in options:
        nxt = np.full(size, inf)
        pick = np.zeros(size, dtype=np.int64)
        for units, dur_s in opts:
            if units > free_cores:
                continue
            cand = dp[: size - units] + dur_s
            seg = nxt[units:]
            better = cand < seg
            seg[better] = cand[better]
            pick[units:][better] = units
        if not np.isfinite(nxt).any():
            return None
        dp = nxt
        picks.append(pick)
    used = int(np.argmin(dp))
    total = float(dp[used])
    choice: list[int] = []
    for pick in reversed(picks):
        units = int(pick[used])
        choice.append(units)
        used -= units
    choice.reverse()
    return total, choice
