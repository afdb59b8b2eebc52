"""Reward actions end to end: client -> scheduler (GPU chunk) -> GPU worker -> Triton -> result,
and Triton SIGKILLed mid-batch with nothing lost.

Real processes throughout: embedded Redis, `tangram scheduler`, `tangram worker gpu` (which
starts a real tritonserver from nvidia-pytriton in explicit model-control mode, CPU-kind
instances here), tiny reward models built locally with save_pretrained.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.sandbox import require_sandbox
from tests.fixtures.triton import reward_config_dict

pytestmark = pytest.mark.slow


@pytest.fixture
def gpu_deployment(tmp_path: Path, tiny_models: dict[str, Path]) -> Iterator[Any]:
    from tangram_celery.common.config import load_config
    from tangram_celery.deploy import Deployment

    # no warm-up: these tests are about loading on demand (test_warm_start.py covers warm-up)
    cfg = reward_config_dict(tmp_path / "state", tiny_models, warm_up=False)
    cfg["reward_models"] = [m for m in cfg["reward_models"] if m["name"] in ("rm", "math")]
    cfg["nodes"]["cpu"] = [{"name": "n0", "cores": 2, "memory_mb": 4096}]  # rule verifiers run here
    cfg["sandbox"] = {"backend": "namespace"}
    require_sandbox(cfg["sandbox"])
    path = tmp_path / "tangram.yaml"
    path.write_text(yaml.safe_dump(cfg))
    dep = Deployment(load_config(path), path, with_flower=False)
    try:
        dep.start(progress=False)
        yield dep
    finally:
        dep.stop()
    # Nothing outlives the deployment: not even a tritonserver restarted by a health check
    # (it once did, and its model loads starved the tests that ran next).
    deadline = time.monotonic() + 20
    while _tritonserver_pids(Path(dep.cfg.state_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _tritonserver_pids(Path(dep.cfg.state_dir)), "tritonserver outlived its deployment"


def _tritonserver_pids(state_dir: Path) -> list[int]:
    """tritonserver processes serving this deployment's repository (started by its GPU worker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"tritonserver") and str(state_dir).encode() in b" ".join(argv):
            pids.append(int(entry.name))
    return pids


def _logged(state_dir: Path, ids: set[str], timeout_s: float = 30) -> list[dict[str, Any]]:
    """The scheduler's action-log records of `ids` (it flushes the log every second)."""
    found: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(found) < len(ids) and time.monotonic() < deadline:
        time.sleep(0.5)
        lines = (state_dir / "actions.jsonl").read_text().splitlines()
        found = [rec for rec in map(json.loads, lines) if rec["action_id"] in ids]
    assert len(found) == len(ids), f"{len(found)} of {len(ids)} actions in the scheduler's log"
    return found


def _overlap(spans: list[tuple[float, float]]) -> int:
    """Most spans open at one instant."""
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    best = cur = 0
    for _, d in edges:
        cur += d
        best = max(best, cur)
    return best


def _rows(n: int) -> list[dict[str, str]]:
    return [{"prompt": f"question {k % 5}", "response": f"answer number {k % 5}"} for k in range(n)]


def test_reward_actions_are_scored_by_triton_through_the_scheduler(gpu_deployment: Any) -> None:
    """Given a GPU node (2 GPUs, CPU-kind Triton) with a transformer reward model and a math
    verifier, when reward actions are submitted, then each comes back scored by the model (equal
    inputs give equal scores), rule actions are verified on a CPU node, and unknown models are
    rejected at submit with nothing enqueued."""
    from tangram_celery import ActionRejected, RewardAction, TangramClient

    dep = gpu_deployment
    with TangramClient(dep.url) as client:
        rows = _rows(12)
        handles = [
            client.submit(RewardAction(trajectory_id=f"t{k}", model="rm", inputs=r))
            for k, r in enumerate(rows)
        ]
        math = client.submit(
            RewardAction(
                trajectory_id="m", model="math", inputs={"response": "\\frac{1}{2}", "reference": "0.5"}
            )
        )
        results = [h.result(timeout=300) for h in handles]
        verdict = math.result(timeout=60)
        with pytest.raises(ActionRejected, match="unknown reward model"):
            client.submit(RewardAction(trajectory_id="x", model="nope", inputs={"response": "a"}))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    scores = [float(r.output["score"]) for r in results]  # type: ignore[index]
    by_input: dict[str, set[float]] = {}
    for row, s in zip(rows, scores, strict=True):
        by_input.setdefault(row["prompt"], set()).add(round(s, 4))
    assert all(len(v) == 1 for v in by_input.values()), by_input
    assert len({round(s, 4) for s in scores}) > 1, "a random-init model still tells inputs apart"
    assert all(r.node == "g0" and r.units >= 1 for r in results)
    # What the scheduler learns from is the scoring alone: shorter than the time in the worker,
    # which also holds the batching window and, for the first batch, the replica load.
    assert all(0 < r.exec_s < r.act_s - r.queue_s for r in results), [
        (r.exec_s, r.act_s - r.queue_s) for r in results
    ]
    # Batches: actions that ran together on one chunk (the scheduler sends riders with the
    # action the chunk was allocated to; the worker scores them in one Triton call).
    ids = {r.action_id for r in results}
    runs = _logged(Path(dep.cfg.state_dir), ids)
    widest = max(
        _overlap([(r["started_s"], r["ended_s"]) for r in runs if r["unit_ids"] == c]) for c in ([0], [1])
    )
    print(f"reward actions={len(results)} widest batch on one GPU={widest}")
    assert widest >= 2, "actions for the same model that wait together go as one batch"
    assert verdict.ok and verdict.output["score"] == 1.0, verdict  # type: ignore[index]
    assert verdict.node == "n0", "a rule verifier is a CPU action, not a GPU one"
    # The GPU worker counts replicas loaded on demand (evict-on-execution) for Prometheus.
    port = dep.metrics_ports["worker-gpu-g0"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    loads = [line for line in text.splitlines() if line.startswith('tangram_gpu_restores_total{node="g0"}')]
    assert loads and float(loads[0].split()[-1]) >= 1, loads


def test_triton_killed_mid_batch_loses_nothing(gpu_deployment: Any) -> None:
    """Given reward actions streaming through the GPU worker, when its tritonserver is SIGKILLed
    mid-batch, then it is restarted, and every action completes exactly once with a score (the
    interrupted ones are retried on the restarted server or placed again by the scheduler)."""
    from tangram_celery import RewardAction, TangramClient

    dep = gpu_deployment
    state = Path(dep.cfg.state_dir)
    n = 40
    with TangramClient(dep.url) as client:
        warm = client.submit(RewardAction(trajectory_id="w", model="rm", inputs=_rows(1)[0])).result(
            timeout=300
        )
        assert warm.ok, warm.error
        before = _tritonserver_pids(state)
        assert len(before) == 1, before
        handles = [
            client.submit(RewardAction(trajectory_id=f"t{k}", model="rm", inputs=r))
            for k, r in enumerate(_rows(n))
        ]
        deadline = time.monotonic() + 120
        while sum(h.done() for h in handles) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(before[0], signal.SIGKILL)
        killed_after = sum(h.done() for h in handles)
        results = [h.result(timeout=600) for h in handles]
    after = _tritonserver_pids(state)
    ids = [r.action_id for r in results]
    retried = [r for r in results if r.attempts > 1]
    print(
        f"submitted={n} killed_after={killed_after} completed={len(results)} ok={sum(r.ok for r in results)} "
        f"placed_again={len(retried)} duplicates={len(ids) - len(set(ids))} triton_pids={before}->{after}"
    )
    assert killed_after < n, "the kill should land mid-run"
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert len(set(ids)) == n
    assert after and after != before, "tritonserver should have been restarted"
    logged = _logged(state, set(ids))
    assert sorted(r["action_id"] for r in logged) == sorted(ids), "the scheduler logged each action once"
