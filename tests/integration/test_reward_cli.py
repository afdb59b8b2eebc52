"""`tangram reward deploy|status|undeploy` against a real tritonserver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.fixtures.triton import reward_config_dict


def test_deploy_status_attach_undeploy(tmp_path: Path, tiny_models: dict[str, Path], capsys: Any) -> None:
    """Given a config, when deployed with preload, then status lists READY models, a worker attaches, undeploy stops it."""
    from reward_servers.cli import main
    from reward_servers.service import RewardService
    from reward_servers.triton import pid_alive
    from tangram_celery.common.config import load_config

    data = reward_config_dict(tmp_path / "state", tiny_models)
    data["reward_models"] = [m for m in data["reward_models"] if m["name"] in ("rm", "math")]
    path = tmp_path / "tangram.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        assert main(["deploy", str(path), "--preload"]) == 0
        assert main(["status", str(path)]) == 0
        out = capsys.readouterr().out
        assert "alive" in out and "rm__dop1__g0: READY" in out
        svc = RewardService(load_config(path), attach=True, monitor_interval_s=None).start()
        assert svc.score("rm", [{"response": "hello"}], chunk=(0,))[0]["score"] is not None
        assert svc.health()["stats"]["loads"] == 0  # adopted the preloaded replica
        pid = svc.server.info.pid  # type: ignore[union-attr]
        svc.stop()
        assert pid_alive(pid)  # attaching does not own the server
    finally:
        assert main(["undeploy", str(path)]) == 0
    assert not pid_alive(pid)
    assert main(["status", str(path)]) == 0 and "not deployed" in capsys.readouterr().out
