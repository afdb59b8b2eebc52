"""Turns on a CPU worker's cores (tangram_celery.workers.turns): a message for cores another
still holds waits for it; sharers and other resources take no turn."""

from __future__ import annotations

import threading
import time

import pytest

from tangram_celery.wire import TaskOrder
from tangram_celery.workers.turns import CoreTurns, turn_key

pytestmark = pytest.mark.unit


def _order(**kw: object) -> TaskOrder:
    base: dict[str, object] = {"action_id": "a", "kind": "cpu", "pool": "n", "units": 1, "unit_ids": (0,)}
    return TaskOrder.model_validate({**base, **kw})


def test_turn_key_names_the_cores_of_exclusive_cpu_orders_only() -> None:
    assert turn_key(_order(unit_ids=(2, 3))) == (2, 3)
    assert turn_key(_order(shares=True)) is None  # a time sharer runs beside the holder
    assert turn_key(_order(unit_ids=())) is None
    assert turn_key(_order(kind="gpu")) is None


def test_the_same_cores_take_turns_and_other_cores_do_not_wait() -> None:
    """A second holder of the same cores enters only once the first left; a holder of other
    cores (or of none) enters at once; nothing is left behind."""
    turns = CoreTurns()
    events: list[str] = []
    first_in, release = threading.Event(), threading.Event()

    def first() -> None:
        with turns.turn((0,), 5.0) as mine:
            assert mine
            events.append("first in")
            first_in.set()
            release.wait(5)
            events.append("first out")

    def second() -> None:
        with turns.turn((0,), 5.0) as mine:
            assert mine
            events.append("second in")

    t1 = threading.Thread(target=first)
    t1.start()
    assert first_in.wait(5)
    t2 = threading.Thread(target=second)
    t2.start()
    with turns.turn((1,), 0.1) as mine:
        assert mine  # other cores: no wait
    with turns.turn(None, 0.1) as mine:
        assert mine
    time.sleep(0.1)
    assert events == ["first in"]  # the second waits
    release.set()
    t1.join(5)
    t2.join(5)
    assert events == ["first in", "first out", "second in"]
    assert turns.waiting() == 0


def test_a_turn_that_does_not_come_in_time_holds_nothing() -> None:
    """A waiter past its limit gets False and leaves the cores to their holder, who then leaves
    nothing behind."""
    turns = CoreTurns()
    with turns.turn((0, 1), 1.0) as held:
        assert held
        t0 = time.monotonic()
        with turns.turn((0, 1), 0.05) as mine:
            assert not mine
        assert time.monotonic() - t0 >= 0.05
        assert turns.waiting() == 1
    assert turns.waiting() == 0
    with turns.turn((0, 1), 0.05) as mine:
        assert mine
