"""The scheduler's sandbox bookkeeping: generations, owners, resets, and which sandboxes are gone."""

from __future__ import annotations

import pytest

from scheduler.service import sandboxes
from scheduler.service.sandboxes import SandboxBook, caller_trajectory, is_one_shot, one_shot_key
from tangram_celery.common.records import PinRecord, SandboxReport
from tangram_celery.common.wire import SandboxOrder


def test_a_pinning_action_starts_a_generation_and_consumes_a_reset() -> None:
    """Given a trajectory whose sandbox was lost, when an action pins it again, then the worker
    is told it starts a new generation (that action's id) and that the caller lost its files;
    the next action reuses that generation without a reset."""
    book = SandboxBook()
    book.pinned("t", "a1")
    book.completed("t", "w1", 3)
    book.lost("t", 5.0)
    assert book.reset == {"t": 5.0} and "t" not in book.gen
    assert book.pinned("t", "a2") == SandboxOrder(gen="a2", new=True, reset=True)
    assert book.reuse("t", "a3") == SandboxOrder(gen="a2", new=False, reset=False)
    assert book.reuse("t", "a2").new  # the pinning action placed again may find none yet
    assert book.reset == {}


def test_a_close_forgets_everything_and_one_shot_keys_are_never_reset() -> None:
    """Given a closed trajectory and a one-shot key, when they are released, then neither is
    marked reset."""
    book = SandboxBook()
    book.pinned("t", "a1")
    book.closed("t")
    key = one_shot_key("x")
    book.pinned(key, "x")
    book.lost(key, 1.0)
    assert book.reset == {} and book.gen == {}
    assert is_one_shot(key) and caller_trajectory(key) == "" and caller_trajectory("t") == "t"


def test_gone_sandboxes() -> None:
    """Given idle trajectories owned by workers, when reports and liveness are checked, then a
    sandbox is gone when its owner is not alive, or a report newer than its last completion
    does not list it (with its generation); a report older than the completion proves nothing,
    and a trajectory that never completed an action had no sandbox."""
    book = SandboxBook()
    for tid, worker, seq in [("dead", "w0", 1), ("kept", "w1", 5), ("dropped", "w1", 4), ("newer", "w1", 9)]:
        book.pinned(tid, f"g-{tid}")
        book.completed(tid, worker, seq)
    book.pinned("stale-gen", "g2")
    book.completed("stale-gen", "w1", 2)
    book.pinned("never", "g-never")
    reports = {"w1": SandboxReport(seq=8, held=(("kept", "g-kept"), ("stale-gen", "g1")))}
    lost, never = book.gone(
        ["dead", "kept", "dropped", "newer", "stale-gen", "never"], alive={"w1"}, reports=reports
    )
    assert sorted(lost) == ["dead", "dropped", "stale-gen"]
    assert never == ["never"]


def test_pins_round_trip() -> None:
    """Given a pinned trajectory with an owner, when its pin record goes through Redis's JSON
    and is restored into a new book, then generation and owner are the same; a record written
    before records had a version reads the same, and so does a worker's sandbox report."""
    book = SandboxBook()
    book.pinned("t", "a1")
    book.completed("t", "w1", 7)
    other = SandboxBook()
    pin = PinRecord.parse(book.pin_record("t", "n", 1).dump())
    other.restore_pin("t", pin)
    assert (other.gen, other.owner) == (book.gen, book.owner)
    old = PinRecord.parse('{"node": "n", "memory_mb": 1, "gen": "a1", "owner": ["w1", 7]}')
    assert old == pin and old.v == 1
    report = SandboxReport.parse('{"seq": 3, "held": [["t", "a1"]]}')
    assert (report.seq, report.generations()) == (3, {"t": "a1"})


def test_resets_are_forgotten_after_a_day_or_beyond_a_bound_oldest_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given resets noted over time, expiring forgets those older than a day and, beyond
    RESET_MAX, the oldest ones, and returns what it forgot; a reset noted again moves to the
    young end; resets restored from Redis keep their time order."""
    monkeypatch.setattr(sandboxes, "RESET_MAX", 3)
    book = SandboxBook()
    for i, tid in enumerate(["a", "b", "c", "d", "e"]):
        book.gen[tid] = tid
        book.lost(tid, 1000.0 + i)
    book.note_reset("a", 1010.0)  # seen again later
    assert book.expire_resets(1011.0) == ["b", "c"]
    assert list(book.reset) == ["d", "e", "a"]
    assert book.expire_resets(1004.0 + sandboxes.RESET_TTL_S + 1) == ["d", "e"]
    other = SandboxBook()
    other.restore_resets({"late": 5.0, "early": 1.0, "mid": 3.0})
    assert list(other.reset) == ["early", "mid", "late"]
