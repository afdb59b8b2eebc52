"""Metrics endpoints, the completed-action log and `tangram report` on a live deployment."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tangram_celery import ActionStatus, ApiAction
from tangram_celery.report import write_report


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.deploy(nodes={"cpu": []})
def test_metrics_log_and_report(deployment, client, tmp_path: Path) -> None:
    """Given completed actions, the scheduler and worker endpoints count them, the action log
    holds one record each, and `tangram report` writes its plots."""
    handles = client.submit_many(
        ApiAction(trajectory_id=f"t{i % 3}", api="calc", request={"expr": f"{i}+1"}) for i in range(30)
    )
    assert all(h.result(timeout=60).status is ActionStatus.OK for h in handles)

    targets = json.loads((deployment.state_dir / "metrics.json").read_text())
    ports = {t["labels"]["process"]: int(t["targets"][0].rsplit(":", 1)[1]) for t in targets}
    assert {"scheduler", "worker-api-calc"} <= set(ports)
    worker = _scrape(ports["worker-api-calc"])
    assert 'tangram_worker_outcomes_total{pool="api:calc",status="ok"} 30.0' in worker

    # The scheduler sees completions through the event stream; give it a moment to log them.
    import time

    log = deployment.state_dir / "actions.jsonl"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sched = _scrape(ports["scheduler"])
        if 'tangram_completed_total{kind="api:calc",status="ok"} 30.0' in sched:
            break
        time.sleep(0.5)
    assert 'tangram_completed_total{kind="api:calc",status="ok"} 30.0' in sched
    assert "tangram_act_seconds_bucket" in sched and "tangram_decision_seconds_count" in sched

    deadline = time.monotonic() + 10  # the log is flushed once a second
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 30):
        time.sleep(0.5)
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(recs) == 30 and {r["pool"] for r in recs} == {"api:calc"}
    assert all(r["ended_s"] >= r["started_s"] >= r["submitted_s"] - 1e-3 for r in recs)

    files = write_report(deployment.cfg, tmp_path / "report")
    assert [f.name for f in files] == ["act_over_time.png", "utilisation.png", "summary.json"]
    assert all(f.stat().st_size > 1000 for f in files[:2])
    assert json.loads(files[2].read_text())["actions"] == 30
