"""Admission control, bursts, and clients that die and come back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tangram_celery import ActionStatus, AdmissionError, ApiAction, TangramClient
from tests.integration.conftest import RECORD_API

SLOW = {"name": "slow", "handler": "tests.integration.support:record", "max_concurrency": 1}


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.deploy(apis=[SLOW], nodes={"cpu": []}, scheduler={"max_queued": 50_000})
def test_burst_of_50k_is_held_and_the_next_submit_fails_fast(deployment, client, tmp_path: Path) -> None:
    """Given a pool that drains slowly, a burst of 50,000 submissions is held with bounded
    scheduler memory, and submitting beyond the bound fails at once with a clear error."""
    log = str(tmp_path / "x.log")
    pid = deployment.children["scheduler"].proc.pid
    before_mb = _rss_mb(pid)
    t0 = time.monotonic()
    for lo in range(0, 50_000, 5_000):
        client.submit_many(
            ApiAction(
                trajectory_id=f"t{i % 100}", api="slow", request={"tag": i, "log": log, "sleep_s": 0.05}
            )
            for i in range(lo, lo + 5_000)
        )
    submit_s = time.monotonic() - t0
    time.sleep(5)  # the scheduler reads the whole burst into its waiting queue
    after_mb = _rss_mb(pid)
    # A few have drained meanwhile (one at a time); top the intake up until it refuses.
    with pytest.raises(AdmissionError, match="intake is full"):
        client.submit_many(
            ApiAction(trajectory_id="late", api="slow", request={"tag": -i, "log": log})
            for i in range(1, 2000)
        )
    # The next submission fails at once. (It is a batch of 500: the pool drains about 20 actions
    # a second, so a slot or two may free between the two calls on a loaded machine.)
    t1 = time.monotonic()
    with pytest.raises(AdmissionError, match="intake is full"):
        client.submit_many(
            ApiAction(trajectory_id="later", api="slow", request={"tag": -i, "log": log})
            for i in range(2000, 2500)
        )
    refuse_s = time.monotonic() - t1
    print(
        f"50k burst: submit {submit_s:.1f}s, scheduler RSS {before_mb:.0f} -> {after_mb:.0f} MiB, refusal {refuse_s * 1000:.1f} ms"
    )
    assert after_mb - before_mb < 400, "scheduler memory grew without bound"
    assert refuse_s < 1.0


@pytest.mark.deploy(apis=[RECORD_API], nodes={"cpu": []})
def test_client_killed_and_reconnected_gets_every_result(deployment, tmp_path: Path) -> None:
    """Given a rollout process that submitted actions and was SIGKILLed, a new client picks up
    every result by id, and each action ran exactly once."""
    ids_path, log = tmp_path / "ids.txt", tmp_path / "executions.log"
    n = 60
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.support_client",
            deployment.url,
            str(n),
            str(ids_path),
            str(log),
        ],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ids_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    ids = ids_path.read_text().split()
    assert len(ids) == n
    with TangramClient(deployment.url) as fresh:
        results = [fresh.handle(i).result(timeout=120) for i in ids]
    executed = Counter(int(x) for x in log.read_text().split())
    print(f"submitted={n} completed={len(results)} executions={sum(executed.values())}")
    assert all(r.status is ActionStatus.OK for r in results)
    assert sorted(executed) == list(range(n)) and max(executed.values()) == 1
