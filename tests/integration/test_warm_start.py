"""A fresh deployment warms its reward services at start: the first reward action is no cold load.

Real processes: embedded Redis, scheduler, CPU and GPU workers, a real tritonserver (CPU-kind
instances) serving a tiny seq-cls model that the deployment builds itself (`build:`).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.common import unavailable
from tests.fixtures.sandbox import require_sandbox
from tests.fixtures.triton import reward_deps_missing

pytestmark = pytest.mark.slow


@pytest.fixture
def fresh_gpu_deployment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Iterator[tuple[Any, str]]:
    """Two models that each fill a GPU of a 2-GPU node: warm-up puts `a` on GPU 0, `b` on GPU 1."""
    from tangram_celery.common.config import load_config
    from tangram_celery.deploy import Deployment

    missing = reward_deps_missing()
    if missing:
        unavailable(f"reward dependencies missing: {missing}")
    require_sandbox({"backend": "namespace"})
    model = tmp_path / "models" / "rm"
    cfg = {
        "state_dir": str(tmp_path / "state"),
        "nodes": {
            "cpu": [{"name": "n0", "cores": 2, "memory_mb": 4096}],
            "gpu": [{"name": "g0", "num_gpus": 2, "gpu_memory_mb": 1024}],
        },
        "reward_models": [
            {
                "name": "a",
                "backend": "hf-seq-cls",
                "path": str(model),
                "build": "tiny-seq-cls",
                "memory_mb": 1024,
            },
            {"name": "b", "backend": "hf-seq-cls", "path": str(model), "memory_mb": 1024},
        ],
        "sandbox": {"backend": "namespace"},
    }
    path = tmp_path / "tangram.yaml"
    path.write_text(yaml.safe_dump(cfg))
    dep = Deployment(load_config(path), path, with_flower=False)
    try:
        dep.start(progress=True)
        yield dep, capsys.readouterr().out
    finally:
        dep.stop()


def _counter(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        lines = [
            line for line in resp.read().decode().splitlines() if line.startswith(f'{name}{{node="g0"}}')
        ]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_first_reward_action_after_up_finds_its_model_warm(fresh_gpu_deployment: tuple[Any, str]) -> None:
    """Given a fresh deployment whose reward model is built at first start, when `up` returns,
    then it said it warms the services in the background; once warm, `a` is on GPU 0 and `b` on
    GPU 1, each with a copy in host memory on the other GPU (the host tier, issue 38); the first
    action for `b` runs on GPU 1, where warm-up put it (the scheduler learned that from the GPU
    worker, not from a completion), and the GPU worker loaded nothing on demand for it."""
    dep, out = fresh_gpu_deployment
    assert "building the tiny-seq-cls reward model 'a'" in out
    assert "warming 2 reward service(s) (a, b) on GPU node(s) g0 in the background" in out
    assert (Path(dep.cfg.reward_models[0].path) / "config.json").exists()
    status = dep.wait_warm(timeout_s=600)["g0"]
    assert sorted(status.loaded) == ["a__dop1__g0", "a__dop1__g1", "b__dop1__g0", "b__dop1__g1"]
    assert not status.failed

    from tangram_celery import RewardAction, TangramClient

    with TangramClient(dep.url) as client:
        res = client.submit(RewardAction(trajectory_id="t", model="b", inputs={"response": "yes"})).result(
            timeout=300
        )
    assert res.ok, res.error
    assert res.node == "g0" and res.batch_size == 1
    port = dep.metrics_ports["worker-gpu-g0"]
    assert _counter(port, "tangram_gpu_warm_loads_total") == 4  # two on the GPUs, two in host memory
    assert _counter(port, "tangram_gpu_restores_total") == 0, "the first action paid a load"
    assert _counter(port, "tangram_gpu_host_restores_total") == 0, "the first action paid a restore"
    assert _counter(port, "tangram_gpu_evictions_total") == 0
    log = Path(dep.cfg.state_dir) / "actions.jsonl"
    deadline = time.monotonic() + 30  # the scheduler flushes its action log every second
    while res.action_id not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.3)
    (rec,) = [json.loads(line) for line in log.read_text().splitlines() if res.action_id in line]
    assert rec["unit_ids"] == [1], "placed where warm-up loaded b"
