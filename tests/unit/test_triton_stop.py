"""Stopping a tritonserver stops its whole process group, stubs included (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from reward_servers.triton import group_alive, stop_pid
from tests.integration.lifecycle_support import proc_stat

# A stand-in for tritonserver and one Python-backend stub: the "server" (its command line names
# tritonserver, as `pid_alive` checks) leads its own session and exits at once on SIGTERM; its
# child, like a stub, takes a while to exit after the SIGTERM the group gets.
SERVER = """
import os, signal, sys, time
stub = os.fork()
if stub == 0:
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.0), os._exit(0)))
    while True:
        time.sleep(0.1)
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
print(stub, flush=True)
while True:
    time.sleep(0.1)
"""


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of the process group `pgid`."""
    pids = (int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit())
    return [p for p in pids if (st := proc_stat(p)) is not None and int(st[2]) == pgid and st[0] != "Z"]


def test_stop_waits_for_the_stubs_of_the_server() -> None:
    """Given a server whose stub outlives it by a second after SIGTERM, when it is stopped, then
    stop returns only once no process of its group is left (it returned at the server's exit)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, "tritonserver"], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    stub = int(proc.stdout.readline())
    try:
        assert stub in _group_members(proc.pid)
        t0 = time.monotonic()
        stop_pid(proc.pid, timeout_s=10.0, proc=proc)  # type: ignore[arg-type]
        assert _group_members(proc.pid) == [], "a stub outlived stop"
        assert not group_alive(proc.pid)
        assert time.monotonic() - t0 < 5.0  # the stub's own second, not the SIGKILL deadline
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
