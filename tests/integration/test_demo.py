"""`tangram demo` on the embedded default: a mixed agentic workload on every pool, nothing lost.

The shipped configs/local.yaml (state moved to a temp dir), a real deployment (Redis, scheduler,
CPU/API/GPU workers, tritonserver with CPU-kind instances), a short run of the demo workload.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.fixtures.common import unavailable
from tests.fixtures.sandbox import require_sandbox
from tests.fixtures.triton import reward_deps_missing

pytestmark = pytest.mark.slow


def test_short_demo_uses_every_pool_and_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Given the embedded default config, when a short demo runs, then code, API and reward
    actions all complete (0 lost), the summary has a line per pool (cpu, gpu, api) with ACT,
    the queue/exec split and batch sizes, reward actions of one model were scored together,
    the run's `tangram report` plots are written where the summary says, and no reward action
    paid a model load (the services were warmed at start)."""
    from tangram_celery.common.config import default_config_path, load_config
    from tangram_celery.demo import run_demo
    from tangram_celery.deploy import Deployment

    missing = reward_deps_missing()
    if missing:
        unavailable(f"reward dependencies missing: {missing}")
    raw = yaml.safe_load(default_config_path().read_text())
    raw["state_dir"] = str(tmp_path / "state")
    raw["broker"]["data_dir"] = str(tmp_path / "state" / "redis")
    raw["sandbox"]["backend"] = "namespace"
    require_sandbox(raw["sandbox"])
    for m in raw["reward_models"]:
        if m.get("build"):
            m["path"] = str(tmp_path / "models" / m["name"])
    path = tmp_path / "tangram.yaml"
    path.write_text(yaml.safe_dump(raw))
    dep = Deployment(load_config(path), path, with_flower=False)
    try:
        dep.start(progress=False)
        summary = run_demo(dep.url, dep.cfg, trajectories=6, turns=4)
        with urllib.request.urlopen(f"http://127.0.0.1:{dep.metrics_ports['worker-gpu-g0']}/metrics") as r:
            metrics = r.read().decode()
    finally:
        dep.stop()
    out = capsys.readouterr().out
    assert summary.lost == 0 and summary.submitted == len(summary.done) == 6 * 4 + 6 * 3
    pools = summary.by_pool()
    assert {p: len(ds) for p, ds in pools.items()} == {"cpu": 6 * 3 + 6, "gpu": 12, "api": 6}
    assert "0 lost" in out
    for pool in ("cpu", "gpu", "api"):
        line = next(line for line in out.splitlines() if line.startswith(f"  {pool}: "))
        assert "ACT mean" in line and "queue" in line and "exec" in line and "batch mean" in line, line
    gpu_batches = [d.result.batch_size for d in pools["gpu"]]
    assert max(gpu_batches) >= 2, f"reward actions of one model go as a batch: {gpu_batches}"
    assert all(d.result.ok for d in pools["gpu"]), [d.result.error for d in pools["gpu"]]
    assert summary.report_dir is not None
    assert (summary.report_dir / "act_over_time.png").stat().st_size > 0
    assert (summary.report_dir / "utilisation.png").stat().st_size > 0
    assert f"plots of this run: {summary.report_dir}/act_over_time.png" in out
    # the reward stage found every service warm: the GPU worker loaded nothing on demand
    restores = [line for line in metrics.splitlines() if line.startswith("tangram_gpu_restores_total{")]
    assert restores and float(restores[0].split()[-1]) == 0, restores
