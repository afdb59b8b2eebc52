"""The typed messages between processes: validated once, readable across versions."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tangram_celery.common.actions import ActionStatus, CodeAction, RewardAction
from tangram_celery.common.wire import (
    ActionMeta,
    ChunkServices,
    Completion,
    DispatchRecord,
    EventStatus,
    ResidencyReport,
    TaskOrder,
    parse_event,
    residency,
    resident_map,
)


def test_action_meta_carries_exactly_its_types_fields() -> None:
    """A code action's metadata has cpus and memory, a reward action's its model; metadata of
    one type with another's fields, or without its own, is refused."""
    code = ActionMeta.of(CodeAction(id="c", trajectory_id="t", code="x", cpus="1..4"), 5.0)
    assert (code.cpus, code.memory_mb, code.v) == ((1, 4), 512, 1)
    assert ActionMeta.model_validate_json(code.dumps()) == code
    reward = ActionMeta.of(RewardAction(id="r", model="rm", inputs={}), 5.0)
    assert reward.ephemeral and reward.trajectory_id == "" and reward.model == "rm"
    with pytest.raises(ValidationError, match="needs cpus"):
        ActionMeta(id="x", type="code", submitted_s=0, memory_mb=1)
    with pytest.raises(ValidationError, match="has no model"):
        ActionMeta(id="x", type="api", api="a", model="rm", submitted_s=0)
    with pytest.raises(ValidationError):
        ActionMeta(id="x", type="code", cpus=(3, 2), memory_mb=1, submitted_s=0)


def test_records_written_before_versions_still_read() -> None:
    """A dispatch record and a task order as the scheduler wrote them before the wire models
    (no version, meta rebuilt from the queue entry) parse as version 1."""
    old_record = {
        "alloc": {"action_id": "a", "kind": "cpu", "pool": "n0", "units": 2, "unit_ids": [0, 1]},
        "meta": {
            "id": "a",
            "trajectory_id": "t",
            "submitted_s": 1.5,
            "job_id": "default",
            "priority": 0,
            "type": "code",
            "cpus": [1, 4],
            "memory_mb": 512,
            "has_tests": True,
        },
        "attempt": 2,
        "sandbox": {"gen": "a", "new": True, "reset": False},
    }
    rec = DispatchRecord.model_validate_json(json.dumps(old_record))
    assert rec.v == 1 and rec.alloc.unit_ids == (0, 1) and rec.meta.has_tests and rec.sandbox
    old_order = {**old_record["alloc"], "attempt": 2, "batch": 3}
    assert TaskOrder.model_validate(old_order).batch == 3
    with pytest.raises(ValidationError):
        TaskOrder.model_validate({**old_order, "v": 2})  # a newer writer: refused, not guessed


def test_events_read_with_their_own_statuses_and_residency_as_lists() -> None:
    """Completions carry EventStatus (the final statuses plus retry and unrun); an event
    without a type is a completion; residency goes as (gpus, services) lists both ways."""
    assert {s.value for s in ActionStatus} < {s.value for s in EventStatus}
    assert not EventStatus.RETRY.ran and EventStatus.FAILED.ran
    ev = parse_event('{"status": "retry", "error": "boom", "trajectory_id": "t"}')
    assert isinstance(ev, Completion) and ev.status is EventStatus.RETRY and ev.act_s is None
    held = {(0, 1): ["rm"], (2,): ["sim", "rm"]}
    report = ResidencyReport(pool="g0", resident=residency(held))
    back = parse_event(report.model_dump_json())
    assert isinstance(back, ResidencyReport) and resident_map(back.resident) == held
    with pytest.raises(ValueError):
        parse_event('{"type": "residency", "pool": "g0", "resident": 7}')
    with pytest.raises(ValidationError):
        ChunkServices(gpus=(), services=["rm"])
