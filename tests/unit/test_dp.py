"""DPArrange (Algorithms 3 and 4) against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from scheduler.dp import CpuCores, GpuBuddy, arrange, cpu_arrange
from scheduler.resources import GpuNode


def _brute_cpu(free: int, options: list[list[tuple[int, float]]]) -> float | None:
    best = None
    for combo in itertools.product(*options):
        if sum(u for u, _ in combo) <= free:
            total = sum(d for _, d in combo)
            best = total if best is None else min(best, total)
    return best


def _gpu_feasible(free: set[int], sizes: list[int], num_gpus: int = 8) -> bool:
    """Can aligned chunks of `sizes` be carved out of `free`? (exhaustive)."""
    if not sizes:
        return True
    size, rest = sizes[0], sizes[1:]
    for start in range(0, num_gpus - size + 1, size):
        chunk = set(range(start, start + size))
        if chunk <= free and _gpu_feasible(free - chunk, rest, num_gpus):
            return True
    return False


def _random_options(rng: random.Random, n: int, allowed: list[int]) -> list[list[tuple[int, float]]]:
    out = []
    for _ in range(n):
        t1 = rng.uniform(1, 100)
        p = rng.uniform(0, 1)
        units = sorted(rng.sample(allowed, rng.randint(1, len(allowed))))
        out.append([(u, t1 * ((1 - p) + p / u)) for u in units])
    return out


def test_cpu_dp_matches_brute_force() -> None:
    """Given random small CPU instances, when arranged, then the DP total equals brute force."""
    rng = random.Random(7)
    for _ in range(200):
        free = rng.randint(1, 9)
        options = _random_options(rng, rng.randint(1, 4), [1, 2, 3, 4])
        expect = _brute_cpu(free, options)
        got = cpu_arrange(free, options)
        generic = arrange(CpuCores(free), options)
        if expect is None:
            assert got is None and generic is None
            continue
        assert got is not None and generic is not None
        assert got[0] == pytest.approx(expect)
        assert generic[0] == pytest.approx(expect)
        assert sum(got[1]) <= free
        assert sum(d for opts, u in zip(options, got[1], strict=True) for uu, d in opts if uu == u) == (
            pytest.approx(expect)
        )


def test_gpu_buddy_dp_matches_brute_force() -> None:
    """Given random free GPU sets, when arranged on buddy chunks, then the DP equals brute force."""
    rng = random.Random(11)
    for _ in range(150):
        free = {g for g in range(8) if rng.random() < 0.7}
        node = GpuNode("g", 8, 80_000)
        node.free = set(free)
        options = _random_options(rng, rng.randint(1, 3), [1, 2, 4, 8])
        best = None
        for combo in itertools.product(*options):
            if _gpu_feasible(free, sorted((u for u, _ in combo), reverse=True)):
                total = sum(d for _, d in combo)
                best = total if best is None else min(best, total)
        got = arrange(GpuBuddy.from_counts(node.free_chunk_counts()), options)
        if best is None:
            assert got is None
        else:
            assert got is not None
            assert got[0] == pytest.approx(best)
            assert _gpu_feasible(free, sorted(got[1], reverse=True))


def test_gpu_buddy_take_splits_the_smallest_larger_chunk() -> None:
    """Given one free 8-chunk, when 2 GPUs are taken, then a 2-chunk and a 4-chunk stay free."""
    op = GpuBuddy((0, 0, 0, 1))
    assert op.take(op.start(), 2) == (0, 1, 1, 0)
    assert op.take((1, 0, 0, 0), 2) is None
