"""Parallelism by request length (the EARL idea): profile throughput per DoP, pick a batch's DoP.

A profile holds measured throughput (requests/s) for each DoP option in each sequence-length
bucket. For a batch, the chosen DoP is the largest one whose parallel efficiency
E(d) = tput(d) / (d * tput(1)) stays at or above `min_efficiency`: long requests amortise the
fixed costs and scale well, so they get more GPUs; short ones stay at DoP 1. E(d) is also what the
scheduler's duration model dur(m) = T1 / (E(m) * m) wants.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_BUCKETS = (64, 256, 1024)  # upper bounds, in approximate tokens; one more bucket above


def approx_tokens(inputs: Mapping[str, Any]) -> int:
    """A cheap length estimate of one request, in tokens (~4 characters per token)."""
    return sum(len(v) for v in inputs.values() if isinstance(v, str)) // 4 + 1


def batch_tokens(batch: Sequence[Mapping[str, Any]]) -> int:
    """The longest request of a batch, in approximate tokens (padding makes it the cost driver)."""
    return max((approx_tokens(r) for r in batch), default=0)


@dataclass
class DopProfile:
    """Throughput (requests/s) per (DoP, length bucket) for one model."""

    model: str
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    tput: dict[int, list[float]] = field(default_factory=dict)  # dop -> per-bucket requests/s
    min_efficiency: float = 0.6

    def bucket(self, tokens: int) -> int:
        """Index of the bucket holding `tokens` (len(buckets) for longer ones)."""
        return next((i for i, b in enumerate(self.buckets) if tokens <= b), len(self.buckets))

    def efficiency(self, dop: int, bucket: int) -> float:
        """E(dop) in `bucket`, relative to DoP 1 (1.0 when unmeasured)."""
        base = self.tput.get(1, [])
        if dop == 1 or dop not in self.tput or not base or base[bucket] <= 0:
            return 1.0
        return self.tput[dop][bucket] / (dop * base[bucket])

    def pick(self, tokens: int, options: Sequence[int], max_dop: int | None = None) -> int:
        """The DoP for a batch whose longest request has `tokens`, among `options` (<= max_dop)."""
        allowed = sorted(d for d in options if max_dop is None or d <= max_dop) or [min(options)]
        b = self.bucket(tokens)
        chosen = allowed[0]
        for d in allowed[1:]:
            if d in self.tput and self.efficiency(d, b) >= self.min_efficiency:
                chosen = d
        return chosen

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "buckets": list(self.buckets),
            "tput": {str(d): v for d, v in self.tput.items()},
            "min_efficiency": self.min_efficiency,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DopProfile:
        return cls(
            model=d["model"],
            buckets=tuple(d["buckets"]),
            tput={int(k): [float(x) for x in v] for k, v in d["tput"].items()},
            min_efficiency=float(d.get("min_efficiency", 0.6)),
        )

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: Path) -> DopProfile:
        return cls.from_json(json.loads(path.read_text()))


def synthetic_batch(tokens: int, size: int, keys: Sequence[str]) -> list[dict[str, str]]:
    """`size` requests of about `tokens` tokens each, with string inputs `keys`."""
    chars = max(4, tokens * 4 // max(1, len(keys)))  # approx_tokens counts ~4 characters a token
    text = ("the answer is yes " * (chars // 18 + 1))[:chars]
    return [{k: text for k in keys} for _ in range(size)]


def measure(
    model: str,
    run: Callable[[list[dict[str, str]], int], object],
    dops: Sequence[int],
    keys: Sequence[str],
    *,
    buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    batch_size: int = 16,
    repeats: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> DopProfile:
    """Profile `run(batch, dop)` (e.g. a bound `RewardService.score`) for each DoP and bucket.

    Each cell runs one warm-up batch, then `repeats` timed batches; throughput is requests/s.
    """
    prof = DopProfile(model, buckets)
    lengths = [*buckets, buckets[-1] * 2]
    for dop in dops:
        row = []
        for tokens in lengths:
            batch = synthetic_batch(max(1, tokens * 3 // 4), batch_size, keys)
            run(batch, dop)
            t0 = clock()
            for _ in range(repeats):
                run(batch, dop)
            row.append(batch_size * repeats / max(clock() - t0, 1e-9))
        prof.tput[dop] = row
    return prof
