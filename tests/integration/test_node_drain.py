"""Nodes joining and draining for real: Redis, `tangram scheduler`, two `tangram worker cpu`
processes (one for a declared node, one for a node the config does not declare) and a client
workload, all started by this test and stopped by pid. SIGTERM to the undeclared node's worker
mid-run drains it: every action completes exactly once, nothing new goes there once it drains,
and its record ends as `left` (then removed), never `lost`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.fixtures.procs import Procs, read_progress, stop_groups, wait_for
from tests.fixtures.sandbox import require_sandbox

ROOT = Path(__file__).resolve().parents[2]
TRAJECTORIES, TURNS = 12, 5
SANDBOX = {"backend": "namespace", "default_timeout_s": 30, "idle_ttl_s": 120}

pytestmark = pytest.mark.slow


def _config(tmp: Path) -> Path:
    cfg = {
        "state_dir": str(tmp / "state"),
        "nodes": {"cpu": [{"name": "a", "cores": 2, "memory_mb": 8192}]},
        "sandbox": SANDBOX,
    }
    path = tmp / "drain.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _wait(what: str, cond: Callable[[], object], timeout_s: float, procs: Procs) -> None:
    wait_for(what, cond, timeout_s, procs, may_exit=("client", "worker-b"), poll_s=0.1)


def test_sigterm_drains_an_undeclared_node_under_load_losing_nothing(tmp_path: Path) -> None:
    """Given a declared node a and an undeclared node b (joined with `--node b`) under a client
    workload, when b's worker gets SIGTERM mid-run, then b is marked draining at once, its
    running actions finish, its worker exits and its
    record says `left` (or is gone), and every action completes exactly once with the right
    output."""
    from tangram_celery.common.node_record import NodeState
    from tangram_celery.store import Store
    from tangram_celery.transport.broker import EmbeddedRedis

    require_sandbox(SANDBOX)
    config = _config(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    redis = EmbeddedRedis(tmp_path / "redis").start()
    env = dict(os.environ, TANGRAM_BROKER_URL=redis.url, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    env.pop("TANGRAM_NODE", None)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    store = Store(redis.url)

    def start(name: str, argv: list[str]) -> None:
        with open(logs / f"{name}.log", "ab") as out:
            procs[name] = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )

    cli = [sys.executable, "-m", "tangram_celery.cli"]
    out, progress = tmp_path / "results.json", tmp_path / "progress.txt"
    try:
        start("scheduler", [*cli, "scheduler", "--config", str(config)])
        start("worker-a", [*cli, "worker", "cpu", "--node", "a", "--config", str(config)])
        start(
            "worker-b",
            [
                *cli,
                "worker",
                "cpu",
                "--node",
                "b",
                "--cores",
                "2",
                "--memory-mb",
                "8192",
                "--config",
                str(config),
            ],
        )
        ready = lambda: all(  # noqa: E731
            (r := store.node_records().get(n)) is not None and r.state is NodeState.READY for n in ("a", "b")
        )
        _wait("both nodes ready", ready, 120, procs)
        rec_b = store.node_records()["b"]
        assert not rec_b.declared and rec_b.cores == 2 and rec_b.memory_mb == 8192
        start(
            "client",
            [
                sys.executable,
                "-m",
                "tests.integration.multinode_client",
                str(out),
                str(progress),
                str(TRAJECTORIES),
                str(TURNS),
            ],
        )

        def both_busy() -> bool:
            done = Counter(node for _, node, _ in read_progress(progress))
            return done["a"] >= 3 and done["b"] >= 3

        _wait("results from both nodes", both_busy, 180, procs)
        procs["worker-b"].send_signal(signal.SIGTERM)  # the worker process only, not its sandboxes
        sent_at = time.monotonic()

        def draining() -> bool:
            r = store.node_records().get("b")
            return r is None or r.state in (NodeState.DRAINING, NodeState.LEFT)

        _wait("b draining", draining, 10, procs)
        procs["worker-b"].wait(timeout=120)
        exited_at_s = time.time()
        exited_in = time.monotonic() - sent_at
        assert procs["worker-b"].returncode == 0, (logs / "worker-b.log").read_text()[-3000:]
        rec = store.node_records().get("b")
        assert rec is None or rec.state is NodeState.LEFT, rec
        _wait("the client to finish", lambda: procs["client"].poll() is not None, 420, procs)
        assert procs["client"].returncode == 0, (logs / "client.log").read_text()[-3000:]
        time.sleep(2)
        assert "b" not in store.node_records(), "the scheduler removes a node that left"
    finally:
        stop_groups(procs, grace_s=20)
        store.close()
        redis.stop()

    results = json.loads(out.read_text())
    ids = Counter(r["action_id"] for r in results)
    log_path = tmp_path / "state" / "actions.jsonl"
    entries = [json.loads(line) for line in log_path.read_text().splitlines()]
    completions = Counter(e["action_id"] for e in entries)
    # what ran on b had been sent to it before it drained (a batch's riders start in turn)
    late_on_b = [e for e in entries if e["pool"] == "cpu:b" and e["started_s"] > exited_at_s]
    by_node = Counter(r["node"] for r in results)
    print(
        f"completed={len(results)} by_node={dict(by_node)} worker_b_exited_in={exited_in:.1f}s "
        f"resets={sum(1 for r in results if r.get('sandbox_reset'))}"
    )
    assert len(results) == TRAJECTORIES * TURNS
    assert max(ids.values()) == 1
    assert all(r["status"] == "ok" for r in results), [r for r in results if r["status"] != "ok"][:3]
    assert all(r["stdout"].strip() == r["expected"] for r in results)
    assert set(completions) == set(ids) and max(completions.values()) == 1, "an action completed twice"
    assert not late_on_b, f"started on b after its worker exited: {late_on_b[:2]}"
    assert any(e["pool"] == "cpu:b" for e in entries), "b took work"
    resets = [r for r in results if r.get("sandbox_reset")]
    assert resets and all("node b was drained" in r["detail"] for r in resets), [
        (r["trajectory_id"], r["node"], r["attempts"], r["detail"]) for r in resets
    ]
