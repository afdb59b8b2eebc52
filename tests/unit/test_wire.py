"""The typed messages between processes: validated once, readable across versions."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tangram_celery.common.actions import ActionStatus, CodeAction, RewardAction
from tangram_celery.common.wire import (
    ActionMeta,
    ActionResult,
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
    assert (code.cpus, code.memory_mb, code.v) == ((1, 4), 512, 2)
    assert ActionMeta.model_validate_json(code.dumps()) == code
    reward = ActionMeta.of(RewardAction(id="r", model="rm", inputs={}), 5.0)
    assert reward.one_shot and reward.trajectory_id == "" and reward.model == "rm"
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


def test_metadata_of_version_1_reads_its_ephemeral_field_as_one_shot() -> None:
    """Given metadata a version-1 client wrote (`ephemeral`), when read, then it is one-shot, and
    what is written now names the field `one_shot` at version 2."""
    old = {"v": 1, "id": "a", "type": "api", "api": "calc", "submitted_s": 1.0, "ephemeral": True}
    meta = ActionMeta.model_validate_json(json.dumps(old))
    assert meta.one_shot and meta.v == 1
    del old["v"]  # written before versions
    assert ActionMeta.model_validate_json(json.dumps(old)).one_shot
    written = json.loads(ActionMeta.of(CodeAction(id="c", code="x"), 1.0).dumps())
    assert written["one_shot"] is True and written["v"] == 2 and "ephemeral" not in written


def test_a_completion_is_built_from_its_result_in_one_place() -> None:
    """Given a finished result, when its event is built, then it carries the result's status,
    timings, units, attempt and trajectory, with the worker's name and counter."""
    res = ActionResult(
        action_id="a",
        trajectory_id="t",
        status=ActionStatus.FAILED,
        exec_s=1.5,
        queue_s=0.5,
        act_s=2.0,
        units=2,
        attempts=3,
        cpu_s=1.0,
    )
    ev = Completion.of(res, "w", 7)
    assert (ev.status, ev.worker, ev.seq, ev.trajectory_id) == (EventStatus.FAILED, "w", 7, "t")
    assert (ev.exec_s, ev.queue_s, ev.act_s, ev.units, ev.attempt, ev.cpu_s) == (1.5, 0.5, 2.0, 2, 3, 1.0)
    assert ev.resident is None
    assert {s.value for s in ActionStatus} <= {s.value for s in EventStatus}  # every result's status


def test_results_are_versioned_and_read_without_a_version() -> None:
    """A result carries its version; one stored before results had a version reads as 1."""
    res = ActionResult(action_id="a", status=ActionStatus.OK)
    assert json.loads(res.model_dump_json())["v"] == 1
    old = ActionResult.model_validate_json('{"action_id": "a", "status": "ok", "attempts": 2}')
    assert old.v == 1 and old.ok and old.attempts == 2
    with pytest.raises(ValidationError):
        res.stdout = "x"  # type: ignore[misc]  # built once, with its timings


def test_restore_tiers_travel_from_result_to_completion_and_old_records_read() -> None:
    """A GPU call's result says where its model was and what restoring it took; its completion
    carries that and the node's host-memory map. Results, completions and residency reports
    written before the host tier existed read with no tier, no load and no host map."""
    res = ActionResult(action_id="a", status=ActionStatus.OK, load_tier="host", load_s=0.02)
    host = residency({(1,): ["sim"]})
    ev = Completion.of(res, "w", 1, residency({(0,): ["rm"]}), host)
    assert (ev.load_tier, ev.load_s, ev.host_resident) == ("host", 0.02, host)
    back = parse_event(ev.model_dump_json(exclude_none=True))
    assert isinstance(back, Completion) and resident_map(back.host_resident or []) == {(1,): ["sim"]}
    old_res = ActionResult.model_validate_json('{"v": 1, "action_id": "a", "status": "ok"}')
    assert (old_res.load_tier, old_res.load_s) == ("", 0.0)
    old_ev = parse_event('{"v": 1, "status": "ok", "resident": [{"gpus": [0], "services": ["rm"]}]}')
    assert isinstance(old_ev, Completion)
    assert (old_ev.load_tier, old_ev.load_s, old_ev.host_resident) == ("", 0.0, None)
    old_rep = parse_event('{"type": "residency", "pool": "g0", "resident": []}')
    assert isinstance(old_rep, ResidencyReport) and old_rep.host_resident is None
    newer = ActionResult.model_validate({"action_id": "a", "status": "ok", "load_tier": "disk"})
    assert newer.load_tier == "disk"  # a client reads a tier it does not know (the scheduler skips it)
