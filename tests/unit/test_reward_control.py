"""The host tier's control channel (`reward_servers.control`): private directory, a command
reaching every instance of a replica, answers and failures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from reward_servers.control import (
    ControlError,
    ControlServer,
    command,
    control_dir,
    ensure_private,
    record,
    socket_path,
)


def test_a_command_reaches_every_instance_and_a_missing_one_is_an_error(tmp_path: Path) -> None:
    d = ensure_private(tmp_path / "ctl" / "repo")
    seen: list[tuple[str, str]] = []

    def handler(instance: str) -> Any:
        def handle(cmd: str) -> dict[str, Any]:
            seen.append((instance, cmd))
            return {"on_device": cmd == "restore", "seconds": 0.001}

        return handle

    servers = [ControlServer(socket_path(d, "rm__dop2__g0", f"i{k}"), handler(f"i{k}")) for k in range(2)]
    try:
        answers = command(d, "rm__dop2__g0", "offload", instances=2)
        assert [a["on_device"] for a in answers] == [False, False]
        assert sorted(seen) == [("i0", "offload"), ("i1", "offload")]
        with pytest.raises(ControlError, match="2 control socket"):
            command(d, "rm__dop2__g0", "restore", instances=3)
        with pytest.raises(ControlError, match="unknown command"):
            command(d, "rm__dop2__g0", "rm -rf", instances=2)
    finally:
        for s in servers:
            s.close()
    assert not list(d.glob("*.sock"))


def test_an_instance_whose_move_fails_answers_so(tmp_path: Path) -> None:
    d = ensure_private(tmp_path / "ctl" / "repo")

    def handle(cmd: str) -> dict[str, Any]:
        raise RuntimeError("CUDA out of memory")

    server = ControlServer(socket_path(d, "a", "i0"), handle)
    try:
        with pytest.raises(ControlError, match="CUDA out of memory"):
            command(d, "a", "restore", instances=1)
    finally:
        server.close()


def test_a_directory_others_can_enter_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "ctl"
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    with pytest.raises(PermissionError, match="not a private directory"):
        ensure_private(planted / "repo")


def test_the_directory_is_recorded_beside_the_repository(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    guessed = control_dir(repo)
    assert len(str(socket_path(guessed, "x" * 200, "y" * 200))) < 108  # a Unix socket's limit
    record(repo, tmp_path / "elsewhere")
    assert control_dir(repo) == tmp_path / "elsewhere"
