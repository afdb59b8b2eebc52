"""How tritonserver is started with restricted APIs, and where its key is kept (issue 37)."""

from __future__ import annotations

import stat
from pathlib import Path

from reward_servers.triton import RESTRICTED_HEADER, ServerInfo, TritonController, server_args


def test_every_api_but_health_is_restricted_on_both_protocols(tmp_path: Path) -> None:
    """Given a key, then the HTTP and gRPC restrictions name every API but health, with that key."""
    args = server_args(tmp_path / "tritonserver", tmp_path / "repo", tmp_path / "be", (1, 2, 3), "k3y")
    http = next(a for a in args if a.startswith("--http-restricted-api="))
    grpc = next(a for a in args if a.startswith("--grpc-restricted-protocol="))
    apis, _, check = http.split("=", 1)[1].partition(":")
    assert check == f"{RESTRICTED_HEADER}=k3y"
    assert set(apis.split(",")) == {
        "metadata", "inference", "shared-memory", "model-config", "model-repository",
        "statistics", "trace", "logging",
    }  # fmt: skip
    assert grpc.split("=", 1)[1] == http.split("=", 1)[1]
    assert "--http-address=127.0.0.1" in args and "--grpc-address=127.0.0.1" in args


def test_server_info_with_the_key_is_owner_only(tmp_path: Path) -> None:
    """Given a server's info, when saved, then the file is mode 0600 and loads back with its key."""
    path = tmp_path / "server.json"
    path.write_text("{}")
    path.chmod(0o644)
    info = ServerInfo(1, 2, 3, 4, "repo", "log", "s3cret")
    info.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ServerInfo.load(path) == info


def test_controller_sends_the_key_and_an_old_info_file_still_loads(tmp_path: Path) -> None:
    """Given info without a key (written before issue 37), then it loads and its controller sends
    no header; given one with a key, the controller sends it."""
    path = tmp_path / "server.json"
    path.write_text(
        '{"pid": 1, "http_port": 2, "grpc_port": 3, "metrics_port": 4, "repository": "r", "log_path": "l"}'
    )
    assert TritonController.of(ServerInfo.load(path)).headers == {}
    ctl = TritonController.of(ServerInfo(1, 2, 3, 4, "r", "l", "abc"))
    assert ctl.headers == {RESTRICTED_HEADER: "abc"}
    ctl.retarget("127.0.0.1:9", "new")
    assert ctl.headers == {RESTRICTED_HEADER: "new"} and ctl.url == "127.0.0.1:9"
