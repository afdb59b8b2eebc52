"""The sandbox runner's child-process pump (`_tangram_proc.Action`), run in this process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tangram_celery.sandbox.inside._tangram_proc import Action

pytestmark = pytest.mark.unit


def action(workdir: Path, timeout_s: float) -> Action:
    uid = os.getuid()
    req = {
        "uid": uid,
        "workdir": str(workdir),
        "max_output_bytes": 1 << 20,
        "timeout_s": timeout_s,
        "cores": [],
    }
    return Action(req)


@pytest.mark.skipif(os.getuid() != 0, reason="children drop their groups (setgroups), which needs root")
def test_a_child_that_closed_its_output_early_does_not_take_a_later_childs_fds(tmp_path: Path) -> None:
    """Given a child A that closes its stdout/stderr at once and exits later, and a child D
    spawned after A's pipes were closed (so D's descriptors reuse their numbers), when A exits,
    then D's output and exit are still D's: A's end must not close or read D's descriptors.
    (This lost a test case's exit in CI: it waited until the deadline and timed out.)"""
    act = action(tmp_path, timeout_s=20.0)
    try:
        a = act.spawn("a", None, argv=["/bin/sh", "-c", "exec >&- 2>&-; sleep 1"])
        c = act.spawn("c", None, argv=["/bin/sh", "-c", "sleep 0.3"])
        assert act.wait_any() is c  # meanwhile A's pipes reached EOF and were closed
        d = act.spawn("d", None, argv=["/bin/sh", "-c", "sleep 1.5; echo d-out; echo d-err >&2"])
        done = {act.wait_any(), act.wait_any()}
        assert done == {a, d} and not act.timed_out
        assert (d.returncode, d.stdout, d.stderr) == (0, b"d-out\n", b"d-err\n")
        assert (a.returncode, a.stdout, a.stderr) == (0, b"", b"")
    finally:
        act.close()
