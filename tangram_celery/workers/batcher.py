"""Micro-batching of reward requests that wait together in one GPU worker.

Each Celery task thread hands its request to `Batcher.submit` and blocks. Requests for the same
model on the same GPU chunk (the scheduler sends a batch of actions on one chunk together, see
`scheduler.round.riders`) that arrive within `window_s` of the first one (or until
`max_batch` of them) go to the reward service as one call; every caller gets its own row, and
the seconds the batch took to score (its execution time, without the wait for the window or a
replica load: what the scheduler learns durations from), and the restore the call paid: the
tier its model was found in and the seconds restoring it took (every rider of a batch that
paid a load reports it: what the scheduler learns restore costs from, issue 38).

When the caller knows how many actions the scheduler sent together on its chunk (`expected`,
from the allocation), the batch goes as soon as all of them are in, and waits up to `gather_s`
for them: a fixed window of a few ms splits a batch in pieces when the worker's threads pick the
messages up slowly (a loaded host), and a lone action need not wait for the window at all.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Scoring(NamedTuple):
    """What a score function returns: `reward_servers.service.Traced` has this shape; a plain
    (results, exec_s) pair reads as a call that paid no restore it knows of."""

    results: list[dict[str, Any]]
    exec_s: float  # seconds the scoring took
    tier: str = ""  # `scheduler.gpu_cache.Tier` value the call's replica was found in
    load_s: float = 0.0  # seconds the call spent restoring or loading it


# (model, rows, chunk) -> a `Scoring` (or a tuple of its leading fields)
ScoreFn = Callable[[str, list[Mapping[str, Any]], tuple[int, ...] | None], tuple[Any, ...]]


class Scored(NamedTuple):
    output: dict[str, Any]
    exec_s: float  # seconds the batch this request rode in took to score
    batch_size: int  # requests scored in that one call, this one included
    load_tier: str = ""  # where the batch's model was found (`Scoring.tier`)
    load_s: float = 0.0  # seconds the batch's call spent restoring it


@dataclass
class _Pending:
    chunk: tuple[int, ...] | None
    rows: list[Mapping[str, Any]] = field(default_factory=list)
    futures: list[Future[Scored]] = field(default_factory=list)
    expected: int = 0  # actions sent together on the chunk (0: unknown, wait for the window)


class Batcher:
    def __init__(
        self,
        score: ScoreFn,
        window_s: Callable[[str], float],
        max_batch: Callable[[str], int],
        gather_s: float = 2.0,
    ) -> None:
        self.score = score
        self.window_s = window_s
        self.max_batch = max_batch
        self.gather_s = gather_s
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, tuple[int, ...] | None], _Pending] = {}
        self.calls = 0  # reward-service calls made (for tests and metrics)

    def submit(
        self, model: str, row: Mapping[str, Any], chunk: tuple[int, ...] | None, expected: int = 0
    ) -> Scored:
        """Score one request; blocks until its batch returns. Errors of the batch are raised.

        `expected`: how many requests the scheduler sent together on `chunk`, this one included
        (0 when unknown: the batch then waits `window_s` for company)."""
        fut: Future[Scored] = Future()
        key = (model, chunk)
        flush_now: _Pending | None = None
        with self._lock:
            p = self._pending.get(key)
            if p is None:
                p = self._pending[key] = _Pending(chunk, expected=expected if chunk is not None else 0)
                wait_s = self.window_s(model) if not p.expected else self.gather_s
                timer = threading.Timer(wait_s, self._flush_key, args=(key, p))
                timer.daemon = True
                timer.start()
            p.rows.append(row)
            p.futures.append(fut)
            full = min(p.expected, self.max_batch(model)) if p.expected else self.max_batch(model)
            if len(p.rows) >= full:
                flush_now = self._pending.pop(key)
        if flush_now is not None:
            self._run(model, flush_now)
        return fut.result()

    def _flush_key(self, key: tuple[str, tuple[int, ...] | None], p: _Pending) -> None:
        with self._lock:
            if self._pending.get(key) is not p:
                return  # already flushed because it filled up
            del self._pending[key]
        self._run(key[0], p)

    def _run(self, model: str, p: _Pending) -> None:
        self.calls += 1
        try:
            got = Scoring(*self.score(model, p.rows, p.chunk))
        except BaseException as e:
            for f in p.futures:
                f.set_exception(e)
            return
        tier, load_s = str(got.tier), float(got.load_s)
        for f, res in zip(p.futures, got.results, strict=True):
            f.set_result(Scored(res, got.exec_s, len(p.rows), tier, load_s))
