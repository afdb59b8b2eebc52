"""What the scheduler records about a run: Prometheus metrics and the completed-action log.

The log (`<state_dir>/actions.jsonl`, one JSON object per completed action) is what
`tangram report` plots and what `scheduler.sim.trace.trajectories_from_action_log` replays.
It is rotated at `max_bytes` (to `actions.jsonl.1`, the older ones shifted up to `.<keep>`,
the oldest dropped): a week of training at a hundred actions a second would write tens of GB.
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from scheduler.model import Allocation, QueuedAction
from scheduler.resources import ClusterState
from tangram_celery.common.metrics import SchedulerMetrics
from tangram_celery.common.wire import Completion

LOGGED_KEPT = 65_536  # completions remembered against a second delivery


def family(qa: QueuedAction) -> str:
    return f"{qa.cost.key}:{qa.target}" if qa.target else str(qa.cost.key)


class RunRecorder:
    def __init__(
        self,
        log_path: Path | None,
        metrics: SchedulerMetrics | None = None,
        *,
        max_bytes: int = 256 << 20,
        keep: int = 4,
    ) -> None:
        self.metrics = metrics or SchedulerMetrics()
        self._pools_seen: set[str] = set()
        # (action, attempt) of the last completions logged: one that reaches the scheduler twice
        # is logged and counted once (a Redis that lost its last second of AOF on a kill may
        # take a worker's retried completion again after the first was read)
        self._logged: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._log: IO[str] | None = None
        self._path = log_path
        self.max_bytes, self.keep = max_bytes, keep
        self._size = 0
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._open()

    def _open(self) -> None:
        assert self._path is not None
        self._log = open(self._path, "a", buffering=1 << 16)  # noqa: SIM115 - closed in close()
        self._size = self._log.tell()

    def _rotate(self) -> None:
        """actions.jsonl -> .1 -> .2 ... -> .<keep> (the oldest dropped), and a new file."""
        assert self._log is not None and self._path is not None
        self._log.close()
        rotated = [self._path.with_name(f"{self._path.name}.{i}") for i in range(1, self.keep + 1)]
        for older, newer in zip(reversed(rotated), reversed([self._path, *rotated[:-1]]), strict=True):
            if newer.exists():
                newer.replace(older)  # the oldest is overwritten
        self._path.unlink(missing_ok=True)  # keep 0: nothing kept
        self._open()

    def dispatched(self, allocs: Sequence[Allocation]) -> None:
        for a in allocs:
            self.metrics.dispatched.labels(pool=f"{a.kind}:{a.pool}").inc()

    def completed(self, qa: QueuedAction | None, alloc: Allocation, ev: Completion) -> None:
        key = (alloc.action_id, ev.attempt)
        if key in self._logged:
            return
        self._logged[key] = None
        if len(self._logged) > LOGGED_KEPT:
            self._logged.popitem(last=False)
        kind = qa.kind if qa else ""
        status = ev.status.value
        self.metrics.completed.labels(kind=kind, status=status).inc()
        if ev.act_s is not None:
            self.metrics.act.labels(kind=kind).observe(ev.act_s)
            self.metrics.queue.labels(kind=kind).observe(ev.queue_s)
        if self._log is None or qa is None or ev.act_s is None:
            return
        rec = {
            "action_id": qa.action_id,
            "trajectory_id": qa.trajectory_id,
            "job_id": qa.job_id,
            "kind": qa.kind,
            "key": str(qa.cost.key),
            "target": qa.target,
            "allowed": list(qa.cost.units.units),
            "units": alloc.units,
            "unit_ids": list(alloc.unit_ids),
            "pool": f"{alloc.kind}:{alloc.pool}",
            "memory_mb": qa.cost.memory_mb,
            "api_quota": qa.cost.api_quota,
            "status": status,
            "submitted_s": qa.submitted_s,
            "started_s": qa.submitted_s + ev.queue_s,
            "ended_s": qa.submitted_s + ev.act_s,
            "attempt": ev.attempt,
        }
        if ev.load_tier:  # a GPU call: where its model was, and what restoring it took (issue 38)
            rec["load_tier"], rec["load_s"] = ev.load_tier, ev.load_s
        line = json.dumps(rec) + "\n"
        self._log.write(line)
        self._size += len(line)
        if self._size >= self.max_bytes:
            self._rotate()

    def snapshot(self, waiting: Sequence[QueuedAction], state: ClusterState, offline: set[str]) -> None:
        """Refresh the gauges from the current queue and resource state."""
        m = self.metrics
        counts = Counter(family(a) for a in waiting)
        units: Counter[str] = Counter()
        for a in waiting:
            units[family(a)] += a.cost.units.min
        self._pools_seen.update(counts)
        for pool in self._pools_seen:
            m.queued.labels(pool=pool).set(counts.get(pool, 0))
            m.queued_units.labels(pool=pool).set(units.get(pool, 0))
        for name, node in state.cpu.items():
            total = sum(len(g) for g in node.numa)
            m.units_total.labels(pool=f"cpu:{name}").set(total)
            m.units_in_use.labels(pool=f"cpu:{name}").set(total - len(node.free) if node.online else 0)
        for name, g in state.gpu.items():
            m.units_total.labels(pool=f"gpu:{name}").set(g.num_gpus)
            m.units_in_use.labels(pool=f"gpu:{name}").set(g.num_gpus - len(g.free))
        for name, api in state.api.items():
            m.units_in_use.labels(pool=f"api:{name}").set(api.in_flight)
        m.pools_offline.set(len(offline))

    def flush(self) -> None:
        if self._log is not None:
            self._log.flush()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
