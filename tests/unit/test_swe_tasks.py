"""The SWE workload's pure parts: task edits, repository layers, trajectory scripts, demo plans."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

from tangram_celery.swe.agent import CHEATS, KINDS, edit_command, steps
from tangram_celery.swe.build import write_repo_tar
from tangram_celery.swe.demo import demo_config, plan
from tangram_celery.swe.tasks import TASKS, Edit, task


def test_an_edit_needs_its_text_exactly_once() -> None:
    """An edit replaces text found once; absent or repeated text is refused, naming the file."""
    e = Edit("m.py", "a + b", "a - b")
    assert e.apply("return a + b\n") == "return a - b\n"
    assert e.reversed().apply("return a - b\n") == "return a + b\n"
    with pytest.raises(ValueError, match=r"m\.py: .* 0 times"):
        e.apply("return b\n")
    with pytest.raises(ValueError, match="2 times"):
        e.apply("a + b; a + b")


def test_every_task_names_its_image_tests_and_files() -> None:
    """Task names are unique; each image is tangram-swe/<name>:bug; hidden tests are node ids in
    the test files the reward sends, and the test command runs exactly those."""
    assert len({t.name for t in TASKS}) == len(TASKS) >= 2
    for t in TASKS:
        assert t.image == f"tangram-swe/{t.name}:bug"
        assert t.hidden_tests and all("::" in n for n in t.hidden_tests)
        assert all(n.split("::")[0] in t.test_files for n in t.hidden_tests)
        assert t.test_command.startswith("python3 -m pytest") and t.test_command.endswith(
            " ".join(t.hidden_tests)
        )
        assert len(t.sdist_sha256) == 64 and t.fix.old == t.bug.new
    with pytest.raises(KeyError, match="known: inflection"):
        task("nope")


def test_a_repository_layer_is_deterministic(tmp_path: Path) -> None:
    """The same files give the same tar bytes: members under repo/, directories first, world
    writable (any sandbox user may edit), fixed owner and time."""
    files = {"pkg/mod.py": b"x = 1\n", "README": b"hi\n"}
    write_repo_tar(files, tmp_path / "a.tar")
    write_repo_tar(dict(reversed(files.items())), tmp_path / "b.tar")
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    with tarfile.open(tmp_path / "a.tar") as tf:
        members = {m.name: m for m in tf.getmembers()}
    assert list(members) == ["repo", "repo/pkg", "repo/README", "repo/pkg/mod.py"]
    assert members["repo/pkg"].mode == 0o777 and members["repo/README"].mode == 0o666
    assert {(m.uid, m.gid) for m in members.values()} == {(0, 0)}


def test_the_edit_command_makes_the_fix(tmp_path: Path) -> None:
    """The agent's bash edit turns the buggy source into the original, byte for byte, and
    fails when the text is not there."""
    t = task("toolz")
    src = tmp_path / t.bug.path
    src.parent.mkdir(parents=True)
    original = "def f(seq, n):\n    yield prev[:len(seq) % n]\n"
    src.write_text(t.bug.apply(original))
    cmd = edit_command(t.fix)
    assert subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True).returncode == 0
    assert src.read_text() == original
    assert subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True).returncode != 0


def test_a_trajectory_is_five_actions_in_its_image() -> None:
    """Every step is a bash action of the task's image in the trajectory; the last grades with
    the hidden tests as files and the task's test command."""
    t = task("inflection")
    hidden = {"test_inflection.py": "def test(): pass\n"}
    for kind in KINDS:
        s = steps(t, "tr-1", hidden, kind)
        assert [x.name for x in s] == ["inspect", "reproduce", "edit", "verify", "reward"]
        assert {(x.action.image, x.action.trajectory_id, x.action.language) for x in s} == {
            (t.image, "tr-1", "bash")
        }
        reward = s[-1].action
        assert reward.grade and reward.files == hidden and reward.test_command == t.test_command
    assert "conftest.py" in steps(t, "tr-1", hidden, "skip-conftest")[2].action.code  # type: ignore[operator]
    with pytest.raises(ValueError, match="unknown trajectory kind"):
        steps(t, "tr-1", hidden, "bribe")


def test_the_demo_plan_spreads_kinds_over_tasks() -> None:
    """Tasks in turn; per task the 2nd trajectory makes no change, the 3rd cheats, others fix."""
    p = plan(24)
    assert len(p) == 24
    for t in TASKS:
        kinds = [k for tt, k in p if tt is t]
        assert kinds[0] == "fix" and kinds[1] == "no-fix" and kinds[2] in CHEATS and set(kinds[3:]) == {"fix"}
    assert {k for _, k in p if k in CHEATS} == set(CHEATS)


def test_the_demo_config_adds_the_layout_and_drops_gpus(tmp_path: Path) -> None:
    """The demo's config keeps the operator's settings, adds the SWE layout once to the image
    store's sources, and has no GPU pool or reward models."""
    src = tmp_path / "in.yaml"
    src.write_text(
        yaml.safe_dump(
            {
                "state_dir": "st",
                "nodes": {"cpu": [{"name": "n", "cores": 2}], "gpu": [{"name": "g"}]},
                "reward_models": [{"name": "rm"}],
                "sandbox": {"backend": "auto", "images": {"oci_dirs": ["/other"]}},
            }
        )
    )
    out = demo_config(src, Path("/lay"), tmp_path / "out.yaml")
    demo_config(out, Path("/lay"), out)  # idempotent
    data = yaml.safe_load(out.read_text())
    assert data["nodes"] == {"cpu": [{"name": "n", "cores": 2}]} and "reward_models" not in data
    assert data["sandbox"] == {"backend": "auto", "images": {"oci_dirs": ["/other", "/lay"]}}
    assert data["state_dir"] == "st"


def test_a_missing_mmdebstrap_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without mmdebstrap (and no cached base) the build stops with the apt-get line to run."""
    from tangram_celery.swe.build import SweBuildError, base_rootfs

    monkeypatch.setenv("TANGRAM_PRETEND_MISSING", "mmdebstrap")
    with pytest.raises(SweBuildError, match="apt-get install mmdebstrap"):
        base_rootfs(tmp_path, log=lambda _: None)
