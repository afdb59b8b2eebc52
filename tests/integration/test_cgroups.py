"""A sandbox's cgroup set on the real kernel: its counters, read through descriptors it keeps
open (`CgroupSet._read(keep=True)`), follow what the processes inside do."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from tests.fixtures.common import unavailable
from tests.fixtures.sandbox import require_sandbox

# burns CPU, then forks until the pids limit refuses
CHILD = """
import os, sys, time
t0 = time.process_time()
while time.process_time() - t0 < 0.2:
    pass
kids = []
for _ in range(8):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    kids.append(pid)
print(len(kids), flush=True)
for k in kids:
    os.kill(k, 9)
"""


def test_counters_read_through_kept_descriptors_follow_the_kernel() -> None:
    """Given a real cgroup set with a pids limit of 3 and a process in it, when the process burns
    0.2 s of CPU and forks until refused, then the counters read before and after (the second
    read through the descriptors the first opened) show the CPU time and the refused forks;
    `destroy` closes the descriptors."""
    require_sandbox({"backend": "namespace"})
    from tangram_celery.sandbox.cgroups import CgroupSet, version

    if version() is None:
        unavailable("no writable cgroup hierarchy with cpu, cpuset, memory and pids here")
    cg = CgroupSet.create(f"test-counters-{uuid.uuid4().hex[:8]}")
    fds_before = set(os.listdir("/proc/self/fd"))
    try:
        cg.set_pids(3)
        before = cg.counters()
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        try:
            for d in set(cg.dirs.values()):
                (d / "cgroup.procs").write_text(str(proc.pid))
        except OSError:
            proc.kill()
            raise
        out, _ = proc.communicate(timeout=30)
        after = cg.counters()
        assert int(out) < 8, "the pids limit refused some forks"
        assert after["pids_max"] > before["pids_max"]
        if "cpu_us" in before:
            assert after["cpu_us"] - before["cpu_us"] >= 150_000
        kept = set(os.listdir("/proc/self/fd")) - fds_before
        assert kept, "the counters are read through descriptors kept open"
    finally:
        cg.destroy()
    assert not set(os.listdir("/proc/self/fd")) - fds_before
