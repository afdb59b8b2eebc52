"""The clock of a CPU batch (`workers.base.OverrunClock`): it hands the riders back when one
action runs too long, not when the batch as a whole does."""

from __future__ import annotations

import threading
import time

from tangram_celery.workers.base import OverrunClock


def test_it_fires_once_when_one_action_runs_past_the_limit() -> None:
    """Given a 0.1 s limit, when no action starts for 0.1 s, then it fires, and only once."""
    fired = threading.Event()
    count = [0]

    def on_overrun() -> None:
        count[0] += 1
        fired.set()

    clock = OverrunClock(0.1, on_overrun)
    clock.start()
    assert fired.wait(5.0)
    time.sleep(0.3)
    clock.stop()
    assert count == [1]


def test_a_batch_that_moves_on_keeps_its_riders() -> None:
    """Given a 0.3 s limit, when a new action starts every 0.05 s for 0.6 s (twice the limit
    in all), then it never fires; after stop it never does either."""
    fired = threading.Event()
    clock = OverrunClock(0.3, fired.set)
    clock.start()
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        clock.restart()
        time.sleep(0.05)
    clock.stop()
    assert not fired.wait(0.5)
