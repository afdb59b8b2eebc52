"""Micro-batching of reward requests in the GPU worker."""

import threading
import time

import pytest

from tangram_celery.workers.batcher import Batcher


def test_requests_waiting_together_go_as_one_call() -> None:
    """Given 8 concurrent requests for one model, the service sees one batched call and each
    caller gets its own row back, with the batch's scoring time (not the window it waited)."""
    calls: list[int] = []

    def score(model, rows, chunk):
        calls.append(len(rows))
        return [{"score": float(r["x"]) * 2} for r in rows], 0.05

    b = Batcher(score, window_s=lambda m: 0.2, max_batch=lambda m: 64)
    out: dict[int, float] = {}
    exec_s: set[float] = set()

    def one(i: int) -> None:
        scored = b.submit("rm", {"x": i}, (0,))
        out[i] = scored.output["score"]
        exec_s.add(scored.exec_s)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [8]
    assert out == {i: 2.0 * i for i in range(8)}
    assert exec_s == {0.05}


def test_full_batch_flushes_early_and_errors_reach_every_caller() -> None:
    """A batch that reaches max_batch goes at once; a failing batch raises in each caller."""
    b = Batcher(
        lambda m, rows, c: ([{"n": len(rows)} for _ in rows], 0.0),
        window_s=lambda m: 30.0,
        max_batch=lambda m: 1,
    )
    t0 = time.monotonic()
    assert b.submit("rm", {}, None).output == {"n": 1}
    assert time.monotonic() - t0 < 5

    def boom(model, rows, chunk):
        raise RuntimeError("triton down")

    bad = Batcher(boom, window_s=lambda m: 0.01, max_batch=lambda m: 8)
    with pytest.raises(RuntimeError, match="triton down"):
        bad.submit("rm", {}, None)


def test_a_batch_sent_together_goes_as_soon_as_it_is_complete() -> None:
    """Given the scheduler sent 5 actions together on a chunk (expected=5) and a long window,
    the batch is scored in one call as soon as the fifth arrives, each caller learning the batch
    size; a lone action (expected=1) is scored at once."""
    calls: list[int] = []

    def score(model, rows, chunk):
        calls.append(len(rows))
        return [{"i": r["i"]} for r in rows], 0.01

    b = Batcher(score, window_s=lambda m: 0.001, max_batch=lambda m: 32, gather_s=30.0)
    sizes: list[int] = []

    def one(i: int) -> None:
        sizes.append(b.submit("rm", {"i": i}, (1,), expected=5).batch_size)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
        time.sleep(0.02)  # picked up one by one, slower than the window
    for t in threads:
        t.join()
    assert calls == [5] and sizes == [5] * 5
    assert time.monotonic() - t0 < 20, "it did not wait for gather_s"
    assert b.submit("rm", {"i": 9}, (0,), expected=1).batch_size == 1
    assert calls == [5, 1]


def test_every_rider_of_a_batch_reports_the_restore_its_call_paid() -> None:
    """Given a score function that reports its call's tier and load seconds (`Traced`'s shape),
    every request of the batch gets them; a plain (results, seconds) pair reports none."""
    from reward_servers.service import Traced
    from scheduler.gpu_cache import Tier

    def score(model, rows, chunk):
        return Traced([{"i": r["i"]} for r in rows], 0.01, Tier.COLD, 4.5)

    b = Batcher(score, window_s=lambda m: 0.001, max_batch=lambda m: 8, gather_s=30.0)
    got = []

    def one(i: int) -> None:
        s = b.submit("rm", {"i": i}, (0,), expected=3)
        got.append((s.load_tier, s.load_s, s.batch_size))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [("cold", 4.5, 3)] * 3
    plain = Batcher(lambda m, rows, c: ([{} for _ in rows], 0.0), lambda m: 0.001, lambda m: 1)
    assert plain.submit("rm", {}, None)[3:] == ("", 0.0)
