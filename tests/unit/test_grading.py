"""What a grade carries over from a trajectory (`tangram_celery/sandbox/grading.py`): the filter,
an upper directory as overlayfs leaves it (whiteouts, opaque directories, metacopy files), its
spill tar, a container's archive, and the fresh layer it seeds. The sandboxes themselves:
tests/integration/test_image_grading.py."""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.common.actions import CodeAction
from tangram_celery.sandbox import grading
from tangram_celery.sandbox.grading import (
    METACOPY,
    REDIRECT,
    GradeRefused,
    allowed,
    container_changes,
    layer_changes,
    put_changes,
    seed_layer,
    spill_changes,
)
from tangram_celery.sandbox.limits import SANDBOX_UID

ROOT = os.geteuid() == 0


@pytest.mark.parametrize(
    ("path", "ok"),
    [
        ("calc.py", True),
        ("src/pkg/core.py", True),
        ("testing.py", True),
        ("README", True),
        ("conftest.py", False),
        ("src/pkg/conftest.py", False),
        ("pytest.ini", False),
        (".pytest.ini", False),
        ("tox.ini", False),
        ("setup.cfg", False),
        ("pyproject.toml", False),
        ("evil.pth", False),
        ("sitecustomize.py", False),
        ("usercustomize.py", False),
        ("tests/helpers.py", False),
        ("src/test/x.py", False),
        ("testing/x.py", False),
        ("test_calc.py", False),
        ("pkg/calc_test.py", False),
        ("__pycache__/calc.cpython-311.pyc", False),
        ("pkg/calc.pyc", False),
        ("evil.dist-info/entry_points.txt", False),
        ("evil.egg-info/entry_points.txt", False),
        (".pytest_cache/v/cache/lastfailed", False),
        ("../etc/passwd", False),
    ],
)
def test_the_filter_keeps_sources_and_drops_test_infrastructure(path: str, ok: bool) -> None:
    assert allowed(path) is ok


def test_a_grade_action_is_validated_at_submit() -> None:
    ok = CodeAction(trajectory_id="t1", grade=True, test_command="python3 -m pytest -q", files={"a": "b"})
    assert ok.grade
    for bad in (
        {"test_command": "pytest"},  # no trajectory
        {"trajectory_id": "t", "ephemeral": True, "test_command": "pytest"},
        {"trajectory_id": "t", "test_command": "make check"},  # no pytest: no verdict of ours
        {"trajectory_id": "t"},
        {"trajectory_id": "t", "test_command": "pytest", "code": "print(1)"},
    ):
        with pytest.raises(ValueError):
            CodeAction(grade=True, files={"a": "b"}, **bad)


def _upper(tmp: Path) -> Path:
    """An upper directory as a trajectory in an image with workdir /repo leaves it."""
    up = tmp / "upper"
    (up / "repo" / "pkg").mkdir(parents=True)
    (up / "repo" / "tests").mkdir()
    (up / "usr" / "lib" / "python3" / "dist-packages").mkdir(parents=True)
    (up / "repo" / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (up / "repo" / "run.sh").write_text("#!/bin/sh\n")
    (up / "repo" / "run.sh").chmod(0o755)
    (up / "repo" / "pkg" / "core.py").write_text("X = 1\n")
    (up / "repo" / "conftest.py").write_text("import pytest\n")
    (up / "repo" / "pytest.ini").write_text("[pytest]\naddopts = -p evil\n")
    (up / "repo" / "tests" / "test_calc.py").write_text("def test_add(): pass\n")
    (up / "repo" / "pkg" / "evil.pth").write_text("import evil\n")
    (up / "usr" / "lib" / "python3" / "dist-packages" / "evil.pth").write_text("import evil\n")
    (up / "repo" / "link.py").symlink_to("/etc/shadow")
    (up / "repo" / "pkg2").symlink_to("/etc")
    return up


def _overlay_marks(up: Path, rootfs: Path) -> None:
    """A whiteout, an opaque directory and metacopy files (one renamed), as overlayfs makes them."""
    os.mknod(up / "repo" / "deleted.py", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    opaque = up / "repo" / "fresh"
    opaque.mkdir()
    os.setxattr(opaque, "trusted.overlay.opaque", b"y")
    (opaque / "new.py").write_text("Y = 2\n")
    (up / "repo" / "chowned.py").write_text("")  # metadata only: the image's data stays
    os.setxattr(up / "repo" / "chowned.py", METACOPY, b"")
    (rootfs / "repo").mkdir(parents=True)
    (rootfs / "repo" / "old_name.py").write_text("RENAMED = True\n")
    (up / "repo" / "new_name.py").write_text("")
    os.setxattr(up / "repo" / "new_name.py", METACOPY, b"")
    os.setxattr(up / "repo" / "new_name.py", REDIRECT, b"/repo/old_name.py")


def _names(changes: grading.Changes) -> dict[str, tuple[int, bytes]]:
    return {rel: (mode, data) for rel, mode, data in changes.files}


def test_an_upper_directory_gives_its_sources_only(tmp_path: Path) -> None:
    up = _upper(tmp_path)
    got = _names(layer_changes(up, "/repo", tmp_path / "rootfs", 1 << 20))
    assert sorted(got) == ["calc.py", "pkg/core.py", "run.sh"]
    assert got["run.sh"][0] == 0o755
    assert got["calc.py"][1].startswith(b"def add")


@pytest.mark.skipif(not ROOT, reason="whiteouts and trusted.* xattrs need root")
def test_overlay_marks_whiteouts_opaque_dirs_and_metacopy(tmp_path: Path) -> None:
    up, rootfs = _upper(tmp_path), tmp_path / "rootfs"
    _overlay_marks(up, rootfs)
    got = _names(layer_changes(up, "/repo", rootfs, 1 << 20))
    # no whiteout, the opaque directory's own files, the renamed file's data from the image
    assert sorted(got) == ["calc.py", "fresh/new.py", "new_name.py", "pkg/core.py", "run.sh"]
    assert got["new_name.py"][1] == b"RENAMED = True\n"


@pytest.mark.skipif(not ROOT or not shutil.which("tar"), reason="trusted.* xattrs need root; GNU tar")
def test_a_spill_tar_gives_what_the_live_layer_gives(tmp_path: Path) -> None:
    from tangram_celery.sandbox.image_root import _tar

    up, rootfs = _upper(tmp_path), tmp_path / "rootfs"
    _overlay_marks(up, rootfs)
    (up / "repo" / "hard.py").hardlink_to(up / "repo" / "calc.py")
    spill = tmp_path / "spill.tar"
    _tar(["-cf", str(spill), "-C", str(up), "."])  # as `Layer.spill` writes it
    live = _names(layer_changes(up, "/repo", rootfs, 1 << 20))
    kept = _names(spill_changes(spill, "/repo", rootfs, 1 << 20))
    assert kept == live


def test_too_many_changed_bytes_are_refused(tmp_path: Path) -> None:
    up = _upper(tmp_path)
    (up / "repo" / "big.bin").write_bytes(b"x" * 5000)
    with pytest.raises(GradeRefused, match="exceed"):
        layer_changes(up, "/repo", tmp_path / "rootfs", 4096)


@pytest.mark.skipif(not ROOT, reason="owners need root")
def test_a_seeded_layer_holds_the_files_as_the_sandbox_users(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "srv").mkdir(parents=True)
    (rootfs / "srv").chmod(0o750)
    (rootfs / "srv" / "app").symlink_to("/elsewhere")
    changes = grading.Changes("/srv/repo", 1 << 20)
    changes.add("pkg/core.py", 0o100644, b"X = 1\n")
    changes.add("run.sh", 0o104755, b"#!/bin/sh\n")  # setuid dropped
    (tmp_path / "upper").mkdir()
    seed_layer(tmp_path / "upper", rootfs, changes)
    core = tmp_path / "upper" / "srv" / "repo" / "pkg" / "core.py"
    assert core.read_bytes() == b"X = 1\n"
    assert (core.stat().st_uid, stat.S_IMODE(core.stat().st_mode)) == (SANDBOX_UID, 0o644)
    assert stat.S_IMODE((tmp_path / "upper" / "srv" / "repo" / "run.sh").stat().st_mode) == 0o755
    srv = (tmp_path / "upper" / "srv").stat()  # the image's directory: its mode and owner
    assert (stat.S_IMODE(srv.st_mode), srv.st_uid) == (0o750, 0)
    # a path whose directory the image has as a link is left out (the link stays)
    linked = grading.Changes("/srv/app", 1 << 20)
    linked.add("x.py", 0o644, b"")
    seed_layer(tmp_path / "upper", rootfs, linked)
    assert not (tmp_path / "upper" / "srv" / "app").exists()


class FakeContainer:
    """A container as the Docker SDK shows it: `diff()`, `get_archive`, `put_archive`."""

    def __init__(self, diff: list[dict[str, Any]], archive: bytes) -> None:
        self._diff, self._archive = diff, archive
        self.put: list[tuple[str, bytes]] = []

    def diff(self) -> list[dict[str, Any]]:
        return self._diff

    def get_archive(self, path: str) -> tuple[Any, dict[str, Any]]:
        data = self._archive
        return iter([data[i : i + 1000] for i in range(0, len(data), 1000)]), {"name": path}

    def put_archive(self, path: str, data: bytes) -> bool:
        self.put.append((path, data))
        return True


def _archive(files: dict[str, bytes], links: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(_dir("repo"))
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        for name, target in links.items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


def _dir(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info


def test_a_containers_changed_sources_go_into_a_fresh_one() -> None:
    files = {
        "repo/calc.py": b"fixed\n",
        "repo/same.py": b"unchanged\n",
        "repo/conftest.py": b"evil\n",
        "repo/tests/test_calc.py": b"evil\n",
    }
    diff = [
        {"Path": p, "Kind": 0}
        for p in ("/repo", "/repo/calc.py", "/repo/conftest.py", "/repo/tests/test_calc.py", "/repo/l.py")
    ]
    diff += [
        {"Path": "/repo/gone.py", "Kind": 2},
        {"Path": "/usr/lib/python3/dist-packages/x.pth", "Kind": 1},
    ]
    source = FakeContainer(diff, _archive(files, {"repo/l.py": "/etc/shadow"}))
    got = container_changes(source, "/repo", 1 << 20)
    assert [(rel, data) for rel, _m, data in got.files] == [("calc.py", b"fixed\n")]
    target = FakeContainer([], b"")
    put_changes(target, got)
    ((path, data),) = target.put
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: (m.uid, m.isreg()) for m in tar}
    assert path == "/" and members == {"repo/calc.py": (SANDBOX_UID, True)}


def test_a_container_without_changes_in_its_workdir_is_not_archived() -> None:
    source = FakeContainer([{"Path": "/tmp/x", "Kind": 1}], b"not a tar")
    assert container_changes(source, "/repo", 1 << 20).files == []


def test_tar_is_gnu_tar() -> None:  # `Layer.spill` writes the spill tars the tests above read
    if shutil.which("tar"):
        assert b"GNU tar" in subprocess.run(["tar", "--version"], capture_output=True, check=True).stdout


def test_the_cpu_worker_sends_a_grade_to_the_sandboxs_grading_path() -> None:
    from tangram_celery.common.actions import ActionStatus
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.common.wire import TaskOrder
    from tangram_celery.sandbox.base import ExecRequest, ExecResult
    from tangram_celery.workers.cpu import CpuHandler

    calls: list[tuple[str, str | None, bool]] = []

    class Box:
        def run(self, tid: str, req: ExecRequest) -> ExecResult:
            calls.append(("run", tid, req.grade))
            return ExecResult(status=ActionStatus.OK)

        def grade(self, tid: str, req: ExecRequest) -> ExecResult:
            calls.append(("grade", tid, req.grade))
            return ExecResult(status=ActionStatus.FAILED)

    order = TaskOrder(action_id="a", kind="cpu", pool="n0", units=1, unit_ids=(0,))
    action = CodeAction(trajectory_id="t", grade=True, test_command="pytest -q", files={"tests/t.py": ""})
    handler = CpuHandler(Box(), SandboxConfig(backend="namespace"))  # type: ignore[arg-type]
    res = handler("a", action.model_dump(mode="json"), order)
    assert res.status is ActionStatus.FAILED and calls == [("grade", "t", True)]
