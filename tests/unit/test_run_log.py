"""The scheduler's run log (scheduler.service.record.RunRecorder): rotation, and reading it back."""

from __future__ import annotations

from pathlib import Path

from scheduler.model import Allocation, CostVector, QueuedAction, ResourceKind
from scheduler.service.record import RunRecorder
from tangram_celery.common.wire import Completion, EventStatus
from tangram_celery.report import load_log


def _complete(rec: RunRecorder, i: int) -> None:
    qa = QueuedAction(f"a{i}", "t", CostVector(ResourceKind.CPU), float(i))
    alloc = Allocation(f"a{i}", ResourceKind.CPU, "n", 1, (0,))
    rec.completed(qa, alloc, Completion(status=EventStatus.OK, queue_s=0.1, act_s=0.5, exec_s=0.4, attempt=1))


def test_the_run_log_is_rotated_and_read_back_oldest_first(tmp_path: Path) -> None:
    """Given a run log rotated every few records with two rotated files kept, when 20 actions
    complete, then at most three files exist, the oldest records are gone, and `load_log` reads
    the rest in completion order across the files."""
    path = tmp_path / "actions.jsonl"
    rec = RunRecorder(path, max_bytes=1500, keep=2)
    for i in range(20):
        _complete(rec, i)
    rec.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["actions.jsonl", "actions.jsonl.1", "actions.jsonl.2"]
    ids = [r["action_id"] for r in load_log(path)]
    assert ids == [f"a{i}" for i in range(20 - len(ids), 20)] and 0 < len(ids) < 20


def test_a_restarted_scheduler_appends_and_counts_what_is_there(tmp_path: Path) -> None:
    """A recorder opened on an existing log appends to it and rotates by its whole size."""
    path = tmp_path / "actions.jsonl"
    path.write_text("x" * 1000 + "\n")
    rec = RunRecorder(path, max_bytes=1200, keep=1)
    _complete(rec, 0)
    rec.close()
    assert (tmp_path / "actions.jsonl.1").exists()
