"""Bounded time sharing carried out for real: a short action starts beside a running one on the
same core, its sandbox at a lower CPU weight, restored when it ends.

1. The CPU worker's handler on each sandbox backend (Docker, bubblewrap, built-in launcher): the
   test runs a long action on core 0 and, while it runs, a time sharer on core 0 (a task order
   with `shares` and `cpu_weight`, as the scheduler sends it).
2. A whole deployment (Redis, scheduler with `tangram-fast`, CPU worker, namespace sandboxes):
   the scheduler, once it has measured the short kind, places it on a core a long action holds
   while every core is held, and the worker runs the two at once.

Each action reports, from inside its sandbox, when it ran and the cores it may run on
(`os.sched_getaffinity`, which follows the sandbox's cpuset). Checks are behaviour, not speed.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.common.actions import CodeAction

# spins on the CPU for `secs`, then reports its span and cores
SPIN = """import json, os, time
t0 = time.time()
while time.time() - t0 < {secs}:
    sum(range(10000))
print(json.dumps({{"start": t0, "end": time.time(), "cores": sorted(os.sched_getaffinity(0))}}))
"""


def _weight(box: Any, trajectory: str) -> float | None:
    """The CPU weight of the trajectory's sandbox relative to the default (None without cgroups)."""
    h = box._handles.get(trajectory)
    if h is None or h.cgroups is None:
        return None
    return float(h.cgroups.cpu_weight())


def test_a_sharer_runs_beside_the_holder_of_its_core_at_a_lower_weight(sandbox_backend: Any) -> None:
    """Given a CPU worker's handler running a 3 s action on core 0, when a time sharer (weight
    0.25) is run on core 0 meanwhile, then it starts and ends while the holder runs, both bound
    to core 0; while it runs its sandbox's CPU weight is a quarter of the default and the
    holder's the default; after it, its weight is the default again, and its result says how
    much CPU time it used."""
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.common.wire import TaskOrder
    from tangram_celery.workers.cpu import CpuHandler

    handler = CpuHandler(sandbox_backend, SandboxConfig(backend="namespace"))
    holder, sharer = "hold-" + uuid.uuid4().hex[:8], "share-" + uuid.uuid4().hex[:8]

    def payload(traj: str, code: str) -> dict[str, Any]:
        return CodeAction(trajectory_id=traj, code=code, timeout_s=60).model_dump(mode="json")

    def order(aid: str, **kw: Any) -> TaskOrder:
        return TaskOrder(action_id=aid, kind="cpu", pool="n0", units=1, unit_ids=(0,), **kw)

    for traj in (holder, sharer):  # warm sandboxes: the overlap below is not a sandbox start
        assert handler(f"w-{traj}", payload(traj, "pass"), order(f"w-{traj}")).status == "ok"
    held: list[Any] = []
    run = threading.Thread(
        target=lambda: held.append(handler("h", payload(holder, SPIN.format(secs=3)), order("h")))
    )
    run.start()
    time.sleep(0.8)
    seen: list[tuple[float | None, float | None]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append((_weight(sandbox_backend, sharer), _weight(sandbox_backend, holder)))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    res = handler("s", payload(sharer, SPIN.format(secs=0.4)), order("s", shares=True, cpu_weight=0.25))
    done.set()
    watcher.join()
    run.join(60)
    [hres] = held
    assert res.status == "ok" and hres.status == "ok", (res, hres)
    s, h = json.loads(res.stdout), json.loads(hres.stdout)
    assert s["cores"] == [0] and h["cores"] == [0]
    assert h["start"] < s["start"] and s["end"] < h["end"], (s, h)
    after = _weight(sandbox_backend, sharer)
    if after is not None:  # the rlimit fallback has no cgroup to weigh
        assert (0.25, 1.0) in seen, seen
        assert all(hw == 1.0 for _, hw in seen), seen
        assert after == 1.0
        # what it is learned by: the CPU time it used, at most its run's length on its core
        assert res.cpu_s is not None and 0 < res.cpu_s <= res.exec_s + 0.05, res


def _sandbox_weights(root: Path = Path("/sys/fs/cgroup")) -> dict[str, float]:
    """Every sandbox cgroup's CPU weight relative to the default (v1 `cpu.shares`, v2 `cpu.weight`)."""
    from tangram_celery.sandbox import cgroups

    ver = cgroups.version(root)
    if ver is None:
        return {}
    parent = root / ("tangram" if ver == 2 else "cpu/tangram")
    name, default = ("cpu.weight", 100) if ver == 2 else ("cpu.shares", 1024)
    out = {}
    for d in parent.glob("*"):
        try:
            out[d.name] = int((d / name).read_text()) / default
        except (OSError, ValueError):
            continue
    return out


@pytest.mark.deploy(
    sandbox={"backend": "namespace", "default_timeout_s": 60},
    scheduler={
        "policy": "tangram-fast",
        "check_invariants": True,
        "priors": {"code": {"t1_s": 0.2}},
        # on a 2-core node the widest host has 2 cores: share one of them at equal weight per
        # sandbox (the sharer gets 2/3 of the core, within half the host's cores' worth)
        "time_share": {"weight": 0.5, "min_share": 0.5, "max_holder_loss": 0.5},
    },
)
def test_the_scheduler_starts_a_short_action_beside_a_long_one(client: Any) -> None:
    """Given a 2-core node where the short kind `code` was measured (five runs), when a 4 s
    action holds both cores (cpus 2) and a short action comes, then the short action starts and
    ends while the long one runs, on one of its cores, its sandbox at half the default CPU weight
    meanwhile; afterwards no sandbox has a lowered weight."""
    for i in range(5):
        assert client.submit(CodeAction(trajectory_id=f"m{i}", code="pass")).result(timeout=60).status == "ok"
    long = client.submit(CodeAction(trajectory_id="long", code=SPIN.format(secs=4), cpus=2, timeout_s=60))
    deadline = time.monotonic() + 30
    while client.store.action_state(long.id) != "running":
        assert time.monotonic() < deadline, "the long action never started"
        time.sleep(0.05)
    time.sleep(0.5)
    seen: list[dict[str, float]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(_sandbox_weights())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    short = client.submit(CodeAction(trajectory_id="short", code=SPIN.format(secs=0.5), timeout_s=60))
    sres = short.result(timeout=60)
    done.set()
    watcher.join()
    lres = long.result(timeout=60)
    assert sres.status == "ok" and lres.status == "ok", (sres, lres)
    s, h = json.loads(sres.stdout), json.loads(lres.stdout)
    assert h["cores"] == [0, 1] and len(s["cores"]) == 1 and s["cores"][0] in h["cores"], (s, h)
    assert h["start"] < s["start"] and s["end"] < h["end"], (s, h)
    assert any(0.5 in w.values() for w in seen), seen
    assert all(w != 0.5 for w in _sandbox_weights().values())
