"""DoP choice by request length, and batch splitting."""

from __future__ import annotations

from reward_servers.client import pieces
from reward_servers.profile import DopProfile, batch_tokens, measure


def test_long_requests_get_more_gpus() -> None:
    """Given DoP 2 scaling well only on long requests, when picking, then short -> 1 and long -> 2."""
    prof = DopProfile("rm", buckets=(64, 256), tput={1: [100.0, 50.0, 10.0], 2: [110.0, 70.0, 19.0]})
    assert prof.pick(10, [1, 2]) == 1
    assert prof.pick(5000, [1, 2]) == 2
    assert prof.pick(5000, [1, 2], max_dop=1) == 1
    assert DopProfile.from_json(prof.to_json()) == prof


def test_measure_fills_every_cell_with_a_clock() -> None:
    """Given a fake run whose cost grows with length and halves at DoP 2, when profiled, then DoP 2 is picked for long."""
    now = [0.0]

    def run(batch: list[dict[str, str]], dop: int) -> None:
        now[0] += 0.01 + batch_tokens(batch) * 1e-4 / dop

    prof = measure("rm", run, [1, 2], ["response"], buckets=(64, 1024), batch_size=4, clock=lambda: now[0])
    assert len(prof.tput[1]) == 3 and prof.pick(2000, [1, 2]) == 2 and prof.pick(10, [1, 2]) == 1


def test_batches_split_by_max_batch_and_parallelism() -> None:
    """Given 70 rows, when split, then pieces respect max batch 32 and DoP 4 gives at least 4 pieces."""
    assert pieces(70, 32) == [(0, 24), (24, 47), (47, 70)]
    assert len(pieces(8, 32, parallel=4)) == 4
    assert pieces(0, 32) == [] and pieces(1, 32, parallel=8) == [(0, 1)]
