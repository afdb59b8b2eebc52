"""The demo's summary: ACT, queue/exec split and batch sizes, overall and per pool (cpu/gpu/api)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tangram_celery.common.wire import ActionResult

POOLS = ("cpu", "gpu", "api")


@dataclass(frozen=True)
class Done:
    """One completed action of the demo: the kind of pool it ran on, what it was, its result."""

    pool: str  # cpu | gpu | api
    what: str  # code, tests, an API name or a reward model name
    result: ActionResult


def _ms(s: float) -> str:
    return f"{s * 1000:.0f} ms"


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


@dataclass
class Summary:
    done: list[Done] = field(default_factory=list)
    submitted: int = 0
    wall_s: float = 0.0
    report_dir: Path | None = None
    report_error: str = ""

    @property
    def results(self) -> list[ActionResult]:
        return [d.result for d in self.done]

    @property
    def lost(self) -> int:
        """Actions submitted that never came back with a result (of any status)."""
        return self.submitted - len(self.done)

    def by_pool(self) -> dict[str, list[Done]]:
        out: dict[str, list[Done]] = {p: [] for p in POOLS}
        for d in self.done:
            out.setdefault(d.pool, []).append(d)
        return out

    def pool_line(self, pool: str) -> str:
        """ACT, the queue/exec split and the batch sizes of the actions that ran on `pool`."""
        ds = self.by_pool().get(pool, [])
        if not ds:
            return f"{pool}: no actions"
        rs = [d.result for d in ds]
        acts = sorted(r.act_s for r in rs)
        kinds = Counter(d.what for d in ds)
        batches = [max(1, r.batch_size) for r in rs]
        return (
            f"{pool}: {len(rs)} actions ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}); "
            f"ACT mean {_ms(statistics.fmean(acts))}, p50 {_ms(_percentile(acts, 0.5))}, "
            f"p99 {_ms(_percentile(acts, 0.99))}; queue {_ms(statistics.fmean(r.queue_s for r in rs))} + "
            f"exec {_ms(statistics.fmean(r.exec_s for r in rs))}; "
            f"batch mean {statistics.fmean(batches):.1f}, max {max(batches)}"
        )

    def reward_line(self) -> str:
        """What the reward models and rule checks said about the trajectories' final answers."""
        parts = []
        scored: dict[str, list[float]] = {}
        for d in self.done:
            if d.pool == "api" or d.what in ("code", "tests") or not d.result.ok:
                continue
            out = d.result.output
            if isinstance(out, dict) and isinstance(out.get("score"), int | float):
                scored.setdefault(d.what, []).append(float(out["score"]))
        for name, scores in sorted(scored.items()):
            if all(s in (0.0, 1.0) for s in scores):
                parts.append(f"{name} {sum(scores):.0f}/{len(scores)} correct")
            else:
                parts.append(f"{name} mean score {statistics.fmean(scores):.2f}")
        return "final answers: " + ", ".join(parts) if parts else ""

    def report(self) -> str:
        rs = self.results
        if not rs:
            return f"no actions completed ({self.lost} lost)"
        acts = sorted(r.act_s for r in rs)
        q = statistics.fmean(r.queue_s for r in rs)
        e = statistics.fmean(r.exec_s for r in rs)
        by_status = Counter(str(r.status) for r in rs)
        lines = [
            f"actions: {len(rs)} completed, {self.lost} lost, in {self.wall_s:.1f} s "
            f"({len(rs) / max(self.wall_s, 1e-9):.1f} actions/s)",
            "by status: " + ", ".join(f"{k}={v}" for k, v in sorted(by_status.items())),
            f"ACT: mean {_ms(statistics.fmean(acts))}, p50 {_ms(_percentile(acts, 0.5))}, "
            f"p99 {_ms(_percentile(acts, 0.99))}",
            f"split: queue {_ms(q)} + exec {_ms(e)} on average ({100 * q / max(q + e, 1e-9):.0f}% queueing)",
            "per pool (batch = actions sent together: scored in one model call on a GPU, run back "
            "to back on the same cores on a CPU node, placed in one round on an API):",
        ]
        lines += [f"  {self.pool_line(p)}" for p in self.by_pool()]
        tests = [r for r in rs if r.tests]
        if tests:
            solved = sum(all(t.passed for t in r.tests) for r in tests)
            lines.append(f"final test suites: {solved}/{len(tests)} passed")
        rewards = self.reward_line()
        if rewards:
            lines.append(rewards)
        if self.report_dir is not None:
            lines.append(
                f"plots of this run: {self.report_dir}/act_over_time.png, utilisation.png, summary.json "
                "(tangram report)"
            )
        elif self.report_error:
            lines.append(f"no plots: {self.report_error}")
        return "\n".join(lines)
