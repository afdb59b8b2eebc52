"""Sandboxes in container images, on both backends (a private dockerd on overlay2, and the
namespace backend's image store reading an OCI layout): the image's tools and Python run user
code while the harness runs on the host's interpreter, files live in the trajectory's layer,
evictions keep files, forks copy them, bad images are statuses (`tests/fixtures/images.py`
makes the images and the `image_box` pools; limits and disk: test_image_limits.py)."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox import ExecRequest
from tests.fixtures.images import CORRUPT, TINY, WORKDIR, ImageBox


def tid() -> str:
    return "i-" + uuid.uuid4().hex[:10]


def ok(res: Any) -> Any:
    assert res.status is ActionStatus.OK, res
    return res


# ---- 1. the image's tools, the host's harness ---------------------------------------------------


def test_bash_runs_in_an_image_without_python(image_box: ImageBox) -> None:
    """Given the tiny image (bash and coreutils, no Python), when bash actions run, then they use
    the image's tools as the sandbox user, in the image's WORKDIR, and see no python3 there."""
    traj = tid()
    res = ok(image_box.run(traj, "id -u; pwd; cat README; ls /usr/bin", new_sandbox=True))
    uid, cwd, readme, *tools = res.stdout.split()
    assert (uid, cwd, readme) == ("10001", WORKDIR, "tiny") and "python3" not in tools, res.stdout
    res = image_box.run(traj, "python3 -c 'print(1)'")
    assert res.status is ActionStatus.FAILED and res.exit_code == 127, res


def test_python_and_assert_tests_in_an_image_without_python_are_refused(image_box: ImageBox) -> None:
    """Given the tiny image, when a python action runs, then it is refused (it never runs on the
    harness's interpreter) saying the image has no Python; assert tests (the harness's verifiers)
    are refused in any image, naming test_command."""
    from tangram_celery.common.actions import TestCase

    res = image_box.run(tid(), "import sys; print(sys.version)", language="python", new_sandbox=True)
    assert res.status is ActionStatus.REJECTED and "no python3" in res.detail and TINY in res.detail, res
    cases = [TestCase(name="a", assert_code="assert True")]
    res = image_box.run(tid(), "true", test_cases=cases, new_sandbox=True)
    assert res.status is ActionStatus.REJECTED and "test_command" in res.detail, res


def test_a_pytest_command_in_an_image_without_python_never_uses_the_harness_python(
    image_box: ImageBox,
) -> None:
    """Given the tiny image, when a test_command runs pytest, then it does not pass, the result
    says there is no Python, and the harness's interpreter (under HOST_DIR) was never started."""
    from tangram_celery.sandbox.image_root import HOST_DIR

    traj = tid()
    ok(image_box.run(traj, "true", files={"tests/test_a.py": "def test_a():\n    pass\n"}, new_sandbox=True))
    res = image_box.run(traj, None, test_command="pytest -q tests")
    assert res.status in (ActionStatus.REJECTED, ActionStatus.FAILED), res
    assert HOST_DIR not in res.stdout + res.stderr and "python" in (res.detail + res.stderr).lower(), res


def test_python_actions_run_on_the_image_python(image_box: ImageBox, python_image: str) -> None:
    """Given the Debian image, when python actions run, then they run on its /usr/bin/python3
    (bookworm's 3.11), not the harness's (the host's, under /opt/tangram/host)."""
    code = "import sys; print(sys.executable, sys.prefix)"
    res = ok(image_box.run(tid(), code, image=python_image, language="python", new_sandbox=True))
    assert res.stdout == "/usr/bin/python3 /usr\n", res.stdout  # as the image's PATH names it


@pytest.mark.parametrize("image_box", ["namespace"], indirect=True)  # the layout's layered image
def test_the_image_python_is_found_on_the_image_path(image_box: ImageBox, venv_image: str) -> None:
    """Given an image whose python3 is only in /opt/venv/bin, on its ENV PATH, when a python
    action runs, then it runs on that python3, as bash in the image finds it."""
    traj = tid()
    res = ok(image_box.run(traj, "command -v python3", image=venv_image, new_sandbox=True))
    assert res.stdout == "/opt/venv/bin/python3\n", res
    res = ok(image_box.run(traj, "import sys; print(sys.executable)", image=venv_image, language="python"))
    assert res.stdout == "/opt/venv/bin/python3\n", res


def test_pytest_verdict_comes_from_the_harness(image_box: ImageBox, python_image: str) -> None:
    """Given a repository test in the image, when `python3 -m pytest` runs as the test command,
    then a passing suite is OK and a failing one FAILED, even when the command ends `; exit 0`."""
    traj = tid()
    tests = "def test_one():\n    assert 1 + 1 == 2\n\ndef test_two():\n    assert {x}\n"
    ok(
        image_box.run(
            traj,
            None,
            image=python_image,
            files={"tests/test_x.py": tests.format(x="True")},
            test_command="python3 -m pytest -q tests",
            new_sandbox=True,
        )
    )
    image_box.run(traj, "true", image=python_image, files={"tests/test_x.py": tests.format(x="False")})
    res = image_box.run(traj, None, image=python_image, test_command="python3 -m pytest -q tests; exit 0")
    assert res.status is ActionStatus.FAILED, res


def test_an_elastic_suite_runs_on_the_image_pytest_without_xdist(
    image_box: ImageBox, python_image: str
) -> None:
    """Given 6 repository tests (one failing) and an image whose pytest has no xdist, when `pytest`
    runs on 2 cores, then every test has its outcome and the verdict is FAILED."""
    traj = tid()
    files = {f"tests/test_{i}.py": f"def test_a{i}():\n    assert {i} != 3\n" for i in range(6)}
    probe = "python3 -c 'import xdist' 2>/dev/null || echo no-xdist"
    res = ok(image_box.run(traj, probe, image=python_image, files=files, new_sandbox=True))
    assert res.stdout == "no-xdist\n"
    res = image_box.run(traj, None, image=python_image, test_command="pytest -q tests", cores=(0, 1))
    assert res.status is ActionStatus.FAILED, res
    outcomes = sorted((t.name, t.passed) for t in res.tests)
    assert outcomes == [(f"tests/test_{i}.py::test_a{i}", i != 3) for i in range(6)], outcomes


FORCE_PASS = (
    "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
    "    out = yield\n    out.get_result().outcome = 'passed'\n"
)
HIDDEN = "from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def test_grade_ignores_planted_test_files_even_after_an_eviction(
    image_box: ImageBox, python_image: str
) -> None:
    """Given a trajectory that planted a conftest forcing every test to pass and rewrote the test
    module, when it is graded with the hidden tests, then its bug still FAILS (the grade runs the
    image plus its source changes only); fixed, it is OK, also from its kept (evicted) files."""
    traj = tid()
    planted = {
        "calc.py": "def add(a, b):\n    return a - b\n",
        "conftest.py": FORCE_PASS,
        "tests/test_calc.py": "def test_add():\n    assert True\n",
    }
    ok(image_box.run(traj, "true", image=python_image, files=planted, sandbox_gen="g1", new_sandbox=True))
    grade: dict[str, Any] = {
        "image": python_image,
        "files": {"tests/test_calc.py": HIDDEN},
        "grade": True,
        "test_command": "python3 -m pytest -q tests",
    }
    res = image_box.pool.grade(traj, ExecRequest(language="bash", code=None, **grade))
    assert res.status is ActionStatus.FAILED, res
    ok(
        image_box.run(
            traj, "true", image=python_image, files={"calc.py": "def add(a, b):\n    return a + b\n"}
        )
    )
    assert (
        image_box.pool.grade(traj, ExecRequest(language="bash", code=None, **grade)).status is ActionStatus.OK
    )
    image_box.pool.close_trajectory(traj, "g1", keep_files=True)
    image_box.wait_kept(traj, python_image)
    res = image_box.pool.grade(traj, ExecRequest(language="bash", code=None, **grade))
    assert res.status is ActionStatus.OK, res
    image_box.pool.close_trajectory(traj)


# ---- 2. files and the root ----------------------------------------------------------------------


def test_files_persist_and_only_the_workdir_and_tmp_are_the_users(image_box: ImageBox) -> None:
    """Given a trajectory, when actions write, then its files persist across actions in the
    WORKDIR (the user's), /tmp is a tmpfs, and the image's system directories refuse writes."""
    traj = tid()
    ok(image_box.run(traj, "mkdir -p src && echo kept > src/a.txt && echo t > /tmp/t", new_sandbox=True))
    res = ok(image_box.run(traj, "cat src/a.txt /tmp/t; stat -c '%u %a' . src; cat /proc/mounts"))
    lines = res.stdout.splitlines()
    assert lines[:4] == ["kept", "t", "10001 755", "10001 755"], lines[:4]
    tmp = [line.split() for line in lines[4:] if line.split()[1:2] == ["/tmp"]]
    assert tmp and tmp[-1][2] == "tmpfs", lines[4:]
    res = image_box.run(traj, "touch /usr/evil; touch /usr/bin/evil; touch /etc/evil; touch /evil; echo done")
    assert res.stderr.count("Permission denied") == 4 and res.stdout == "done\n", res


# ---- 4. eviction ------------------------------------------------------------------------------


def test_eviction_keeps_files_not_processes(image_box: ImageBox) -> None:
    """Given a trajectory evicted with its files kept, when its next action runs (in the next
    generation), then its files are there, `kept_files` and no reset; its session's shell (a
    process) is gone. A plain close then deletes them."""
    traj = tid()
    ok(image_box.run(traj, "echo v1 > f.txt; export FOO=1", session=True, sandbox_gen="g1", new_sandbox=True))
    image_box.pool.close_trajectory(traj, "g1", keep_files=True)
    image_box.wait_kept(traj, TINY)
    res = ok(image_box.run(traj, "cat f.txt; echo ${FOO:-unset}", session=True, sandbox_gen="g2"))
    assert res.stdout == "v1\nunset\n" and res.kept_files and not res.sandbox_reset, res
    image_box.pool.close_trajectory(traj, "g2")
    res = image_box.run(traj, "cat f.txt", sandbox_gen="g3", new_sandbox=True)
    assert res.status is ActionStatus.FAILED and not res.kept_files, res


def test_close_while_evicted_deletes_the_kept_files(image_box: ImageBox) -> None:
    traj = tid()
    ok(image_box.run(traj, "echo v1 > f.txt", sandbox_gen="g1", new_sandbox=True))
    image_box.pool.close_trajectory(traj, "g1", keep_files=True)
    image_box.wait_kept(traj, TINY)
    image_box.pool.close_trajectory(traj)
    assert image_box.pool.images.kept_image(traj) is None
    res = image_box.run(traj, "cat f.txt", sandbox_gen="g2", new_sandbox=True)
    assert res.status is ActionStatus.FAILED and not res.kept_files, res


def test_an_action_right_after_an_eviction_keeps_the_files(image_box: ImageBox) -> None:
    """Given an eviction whose teardown runs in the background, when the trajectory's next action
    comes at once, then it waits for the kept layer and resumes its files."""
    traj = tid()
    ok(image_box.run(traj, "echo v1 > f.txt", sandbox_gen="g1", new_sandbox=True))
    image_box.pool.close_trajectory(traj, "g1", keep_files=True)
    res = image_box.run(traj, "cat f.txt", sandbox_gen="g2")
    assert res.stdout == "v1\n" and res.kept_files and not res.sandbox_reset, res


# ---- 5. fork ----------------------------------------------------------------------------------


def test_fork_copies_the_files_and_the_copies_are_independent(image_box: ImageBox) -> None:
    parent, f1, f2 = tid(), tid(), tid()
    ok(image_box.run(parent, "mkdir -p d && echo base > d/x", new_sandbox=True))
    assert image_box.pool.fork(parent, [f1, f2]) >= 0
    res = ok(image_box.run(f1, "cat d/x; echo f1 > d/x; echo only-f1 > y", new_sandbox=True))
    assert res.stdout == "base\n" and res.kept_files and not res.sandbox_reset, res
    res = ok(image_box.run(f2, "cat d/x; ls d; [ -e y ] || echo no-y", new_sandbox=True))
    assert res.stdout.split() == ["base", "x", "no-y"], res
    ok(image_box.run(parent, "echo parent > d/x"))
    assert ok(image_box.run(f1, "cat d/x y")).stdout == "f1\nonly-f1\n"
    assert ok(image_box.run(f2, "cat d/x")).stdout == "base\n"
    for t in (parent, f1, f2):
        image_box.pool.close_trajectory(t)


# ---- 6. bad images ----------------------------------------------------------------------------


def test_another_image_later_is_rejected_naming_both(image_box: ImageBox, python_image: str) -> None:
    traj = tid()
    ok(image_box.run(traj, "echo", new_sandbox=True))
    res = image_box.run(traj, "echo", image=python_image)
    assert res.status is ActionStatus.REJECTED and TINY in res.detail and python_image in res.detail, res
    ok(image_box.run(traj, "echo still"))  # the trajectory is unharmed


def test_unknown_image_is_rejected_naming_it_and_the_sources(image_box: ImageBox) -> None:
    res = image_box.run(tid(), "echo", image="tangram-test/nope:9", new_sandbox=True)
    assert res.status is ActionStatus.REJECTED and "tangram-test/nope:9" in res.detail, res
    where = "Docker engine" if image_box.backend == "docker" else "OCI dir"
    assert where in res.detail, res.detail


@pytest.mark.parametrize("image_box", ["namespace"], indirect=True)  # an engine checks its own layers
def test_a_corrupt_layer_is_an_error_and_others_are_served(image_box: ImageBox) -> None:
    """Given an image whose layer blob has flipped bytes, when an action names it, then ERROR
    with a detail saying which blob did not match, and other trajectories run on."""
    res = image_box.run(tid(), "echo", image=CORRUPT, new_sandbox=True)
    assert res.status is ActionStatus.ERROR and CORRUPT in res.detail and "digest" in res.detail, res
    assert ok(image_box.run(tid(), "echo fine", new_sandbox=True)).stdout == "fine\n"


def test_a_failed_image_is_not_retried_in_the_background(
    image_box: ImageBox, caplog: pytest.LogCaptureFixture
) -> None:
    """Given an unknown (Docker) or corrupt (namespace) image, when an action names it, then no
    ready sandboxes of it are started in the background afterwards."""
    image = CORRUPT if image_box.backend == "namespace" else "tangram-test/nope:8"
    with caplog.at_level(logging.WARNING):
        res = image_box.run(tid(), "echo", image=image, new_sandbox=True)
        assert res.status in (ActionStatus.ERROR, ActionStatus.REJECTED), res
        time.sleep(3)
    failures = [r for r in caplog.records if "ready sandbox failed" in r.getMessage()]
    assert not failures, [r.getMessage() for r in failures]
