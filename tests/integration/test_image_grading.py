"""Grading a trajectory in an image (`CodeAction.grade`, `tangram_celery/sandbox/grading.py`),
in real sandboxes of a Debian image with python3 and pytest, on both backends (namespace
first): the verdict comes from a fresh sandbox of the image holding only the trajectory's
source changes and the task's hidden tests, judged by the harness's pytest report channel.
Planted conftest.py, pytest.ini, edited tests and `; exit 0` change nothing.

The image: `tests/fixtures/images.py` (`python_image`: mmdebstrap, cached; skipped without
mmdebstrap or the Debian archive unless CI is set)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox import ExecRequest
from tangram_celery.sandbox.base import ExecResult
from tests.fixtures.images import Images, images_config, open_image_pool

BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a * b\n"
HIDDEN = {
    "tests/test_calc.py": (
        "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_add_negative():\n    assert add(-1, 1) == 0\n"
    )
}
COMMAND = "python3 -m pytest -q -p no:cacheprovider tests/test_calc.py"
# a conftest that turns every failure into a pass (it does, in the trajectory's own sandbox)
FORCE_PASS = (
    "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
    "    out = yield\n    rep = out.get_result()\n    rep.outcome = 'passed'\n"
)


@pytest.fixture(scope="module", params=["namespace", "docker"])
def box(
    request: pytest.FixtureRequest,
    image_layout: Images,
    python_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:

    base: dict[str, Any] = {"prewarm": 0, "idle_ttl_s": 600}
    if request.param == "namespace":
        store = tmp_path_factory.mktemp("store")
        base |= {"backend": "namespace", "images": images_config(image_layout, Path(store))}
    else:
        base |= {"backend": "docker", "docker_host": request.getfixturevalue("image_engine")}
    yield from open_image_pool(request.param, base)


def act(box: Any, tid: str, code: str | None = None, **kw: Any) -> ExecResult:
    kw.setdefault("image", "tangram-test/py:1")
    req = ExecRequest(language=kw.pop("language", "bash"), code=code, timeout_s=60.0, cores=(0,), **kw)
    return box.run(tid, req)


def grade(box: Any, tid: str, command: str = COMMAND, files: dict[str, str] | None = None) -> ExecResult:
    req = ExecRequest(
        language="bash",
        code=None,
        files=dict(HIDDEN if files is None else files),
        test_command=command,
        timeout_s=60.0,
        cores=(0,),
        grade=True,
    )
    return box.grade(tid, req)


def trajectory(box: Any, calc: str, files: dict[str, str] | None = None) -> str:
    """A trajectory of the image that wrote the project with `calc` as its fix (and `files`)."""
    tid = f"g-{uuid.uuid4().hex[:10]}"
    res = act(box, tid, "true", files={"calc.py": calc, "README": "a task\n", **(files or {})})
    assert res.status is ActionStatus.OK, res
    return tid


def passed(res: ExecResult) -> bool:
    return res.status is ActionStatus.OK and bool(res.tests) and all(t.passed for t in res.tests)


def test_a_correct_fix_passes_and_a_wrong_one_fails(box: Any) -> None:
    good, bad = trajectory(box, FIXED), trajectory(box, WRONG)
    res = grade(box, good)
    assert passed(res), res
    assert len(res.tests) == 2
    res = grade(box, bad)
    assert res.status is ActionStatus.FAILED, res
    box.close_trajectory(good)
    box.close_trajectory(bad)


def test_the_trajectorys_own_sandbox_is_left_as_it_is(box: Any) -> None:
    tid = trajectory(box, FIXED, {"conftest.py": "X = 1\n"})
    assert passed(grade(box, tid))
    res = act(box, tid, "ls; cat conftest.py; test ! -e tests/test_calc.py && echo no-hidden-tests")
    assert res.status is ActionStatus.OK, res
    assert "calc.py" in res.stdout and "X = 1" in res.stdout and "no-hidden-tests" in res.stdout
    box.close_trajectory(tid)


def test_a_planted_conftest_that_forces_passes_is_ignored(box: Any) -> None:
    tid = trajectory(box, WRONG, {"conftest.py": FORCE_PASS, "tests/conftest.py": FORCE_PASS, **HIDDEN})
    own = act(box, tid, None, test_command=COMMAND)  # the hack works where the trajectory runs
    assert own.status is ActionStatus.OK, own
    res = grade(box, tid)
    assert res.status is ActionStatus.FAILED, res
    box.close_trajectory(tid)


def test_a_planted_conftest_that_skips_everything_is_ignored(box: Any) -> None:
    skip = "import pytest\n\n\ndef pytest_runtest_setup(item):\n    pytest.skip('no')\n"
    tid = trajectory(box, WRONG, {"conftest.py": skip})
    assert grade(box, tid).status is ActionStatus.FAILED
    box.close_trajectory(tid)


def test_edited_hidden_tests_are_overwritten_by_the_tasks(box: Any) -> None:
    mine = {"tests/test_calc.py": "def test_add():\n    pass\n", "test_extra.py": "def test_x():\n    pass\n"}
    tid = trajectory(box, WRONG, mine)
    assert act(box, tid, None, test_command=COMMAND).status is ActionStatus.OK  # its own tests pass
    res = grade(box, tid)
    assert res.status is ActionStatus.FAILED, res
    assert {t.name for t in res.tests} >= {"tests/test_calc.py::test_add"}, res.tests
    box.close_trajectory(tid)


def test_a_planted_pytest_ini_and_plugin_are_ignored(box: Any) -> None:
    ini = "[pytest]\naddopts = -p forcepass\n"
    files = {"forcepass.py": FORCE_PASS, "pytest.ini": ini, "setup.cfg": "[tool:pytest]\n", **HIDDEN}
    tid = trajectory(box, WRONG, files)
    own = act(box, tid, None, test_command=COMMAND)
    assert own.status is ActionStatus.OK, own  # the plugin loads where the trajectory runs
    res = grade(box, tid)  # forcepass.py is carried over (a module), pytest.ini is not
    assert res.status is ActionStatus.FAILED, res
    box.close_trajectory(tid)


def test_a_pth_and_sitecustomize_are_ignored(box: Any) -> None:
    evil = "raise SystemExit(3)\n"
    files = {"evil.pth": "import forcing\n", "sitecustomize.py": evil, "pkg/zz.pth": "import forcing\n"}
    tid = trajectory(box, FIXED, files)
    res = grade(box, tid, command=f"{COMMAND} && ls -a . && test ! -e pkg/zz.pth")
    assert passed(res), res
    assert ".pth" not in res.stdout and "sitecustomize" not in res.stdout
    box.close_trajectory(tid)


def test_the_commands_exit_code_never_decides(box: Any) -> None:
    tid = trajectory(box, WRONG)
    res = grade(box, tid, command=f"{COMMAND}; exit 0")
    assert res.status is ActionStatus.FAILED, res
    res = grade(box, tid, command="echo '2 passed'; exit 0 # pytest")
    assert res.status is not ActionStatus.OK, res
    box.close_trajectory(tid)


def test_an_evicted_trajectory_is_graded_from_what_was_kept(box: Any) -> None:
    tid = trajectory(box, FIXED, {"conftest.py": FORCE_PASS})
    box.close_trajectory(tid, keep_files=True)
    deadline = time.monotonic() + 30
    while box.images.kept_image(tid) is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the layer is kept in the background
    res = grade(box, tid)
    assert passed(res), res
    res = act(box, tid, "cat calc.py")  # resumes on its kept files
    assert res.status is ActionStatus.OK and "a + b" in res.stdout, res
    box.close_trajectory(tid)


def test_what_cannot_be_graded_is_refused(box: Any) -> None:
    res = grade(box, "g-never-ran")
    assert res.status is ActionStatus.REJECTED and "no files on this node" in res.detail, res
    host = f"g-host-{uuid.uuid4().hex[:8]}"
    assert act(box, host, "true", image=None).status is ActionStatus.OK
    res = grade(box, host)
    assert res.status is ActionStatus.REJECTED, res
    box.close_trajectory(host)
