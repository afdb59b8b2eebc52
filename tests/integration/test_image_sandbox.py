"""Sandboxes in container images, on both backends (a private dockerd on overlay2, and the
namespace backend's image store reading an OCI layout): the image's tools and Python run user
code while the harness runs on the host's interpreter, files live in the trajectory's layer,
every limit of a host sandbox holds, evictions keep files, forks copy them, bad images are
statuses (`tests/fixtures/images.py` makes the images)."""

from __future__ import annotations

import logging
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox import ExecRequest
from tests.fixtures.common import unavailable
from tests.fixtures.docker import SMALL_LIMITS
from tests.fixtures.images import CORRUPT, TINY, WORKDIR, Images, images_config

BACKENDS = ["docker", "namespace"]
PROCS = 'for p in /proc/[0-9]*; do read -r c < "$p/comm" && echo "${p#/proc/} $c"; done'


def tid() -> str:
    return "i-" + uuid.uuid4().hex[:10]


@dataclass
class Box:
    """A sandbox pool of one backend, and the images it can run."""

    backend: str
    pool: Any

    def run(self, traj: str, code: str | None, image: str = TINY, **kw: Any) -> Any:
        kw.setdefault("language", "bash")
        return self.pool.run(traj, ExecRequest(code=code, image=image, **kw))

    def wait_kept(self, traj: str, image: str, timeout_s: float = 20.0) -> None:
        """Until the evicted `traj`'s layer (or container) is kept: the eviction is done."""
        deadline = time.monotonic() + timeout_s
        while self.pool.images.kept_image(traj) != image:
            assert time.monotonic() < deadline, f"{traj}'s files were not kept within {timeout_s} s"
            time.sleep(0.05)


@pytest.fixture(scope="module", params=BACKENDS)
def box(
    request: pytest.FixtureRequest, image_layout: Images, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Box]:
    """A pool of each backend in turn with small limits; closed at module end."""
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.common.errors import SandboxError
    from tangram_celery.sandbox import open_sandbox

    cfg: dict[str, Any] = {"backend": request.param, **SMALL_LIMITS, "prewarm": 0}
    if request.param == "docker":
        cfg["docker_host"] = request.getfixturevalue("image_engine")
    else:
        cfg["namespace_launcher"] = "builtin"
        cfg["images"] = images_config(image_layout, tmp_path_factory.mktemp("store"))
    try:
        pool = open_sandbox(SandboxConfig.model_validate(cfg))
    except SandboxError as e:
        unavailable(f"{request.param} sandbox backend unavailable: {e}")
    try:
        yield Box(request.param, pool)
    finally:
        pool.close()


def ok(res: Any) -> Any:
    assert res.status is ActionStatus.OK, res
    return res


# ---- 1. the image's tools, the host's harness ---------------------------------------------------


def test_bash_runs_in_an_image_without_python(box: Box) -> None:
    """Given the tiny image (bash and coreutils, no Python), when bash actions run, then they use
    the image's tools as the sandbox user, in the image's WORKDIR, and see no python3 there."""
    traj = tid()
    res = ok(box.run(traj, "id -u; pwd; cat README; ls /usr/bin", new_sandbox=True))
    uid, cwd, readme, *tools = res.stdout.split()
    assert (uid, cwd, readme) == ("10001", WORKDIR, "tiny") and "python3" not in tools, res.stdout
    res = box.run(traj, "python3 -c 'print(1)'")
    assert res.status is ActionStatus.FAILED and res.exit_code == 127, res


def test_python_and_assert_tests_in_an_image_without_python_are_refused(box: Box) -> None:
    """Given the tiny image, when a python action runs, then it is refused (it never runs on the
    harness's interpreter) saying the image has no Python; assert tests (the harness's verifiers)
    are refused in any image, naming test_command."""
    from tangram_celery.common.actions import TestCase

    res = box.run(tid(), "import sys; print(sys.version)", language="python", new_sandbox=True)
    assert res.status is ActionStatus.REJECTED and "no python3" in res.detail and TINY in res.detail, res
    cases = [TestCase(name="a", assert_code="assert True")]
    res = box.run(tid(), "true", test_cases=cases, new_sandbox=True)
    assert res.status is ActionStatus.REJECTED and "test_command" in res.detail, res


@pytest.mark.xfail(
    strict=True,
    reason="product bug reported to the lead (issue 36): a pytest test_command in an image without "
    "Python is run on the harness's python3 (HOST_DIR), which fails only for want of the host's libm",
)
def test_a_pytest_command_in_an_image_without_python_never_uses_the_harness_python(box: Box) -> None:
    """Given the tiny image, when a test_command runs pytest, then it does not pass, the result
    says there is no Python, and the harness's interpreter (under HOST_DIR) was never started."""
    from tangram_celery.sandbox.image_root import HOST_DIR

    traj = tid()
    ok(box.run(traj, "true", files={"tests/test_a.py": "def test_a():\n    pass\n"}, new_sandbox=True))
    res = box.run(traj, None, test_command="pytest -q tests")
    assert res.status in (ActionStatus.REJECTED, ActionStatus.FAILED), res
    assert HOST_DIR not in res.stdout + res.stderr and "python" in (res.detail + res.stderr).lower(), res


def test_python_actions_run_on_the_image_python(box: Box, python_image: str) -> None:
    """Given the Debian image, when python actions run, then they run on its /usr/bin/python3
    (bookworm's 3.11), not the harness's (the host's, under /opt/tangram/host)."""
    code = "import sys; print(sys.executable, sys.prefix)"
    res = ok(box.run(tid(), code, image=python_image, language="python", new_sandbox=True))
    assert res.stdout == "/usr/bin/python3.11 /usr\n", res.stdout


@pytest.mark.xfail(
    strict=True,
    reason="product gap reported to the lead (issue 36): the image's Python is looked up on a fixed "
    "path (/usr/local/bin:/usr/bin:/bin), not on the image's ENV PATH",
)
@pytest.mark.parametrize("box", ["namespace"], indirect=True)  # the layout's layered image
def test_the_image_python_is_found_on_the_image_path(box: Box, venv_image: str) -> None:
    """Given an image whose python3 is only in /opt/venv/bin, on its ENV PATH, when a python
    action runs, then it runs on that python3, as bash in the image finds it."""
    traj = tid()
    res = ok(box.run(traj, "command -v python3", image=venv_image, new_sandbox=True))
    assert res.stdout == "/opt/venv/bin/python3\n", res
    res = ok(box.run(traj, "import sys; print(sys.executable)", image=venv_image, language="python"))
    assert res.stdout == "/opt/venv/bin/python3\n", res


def test_pytest_verdict_comes_from_the_harness(box: Box, python_image: str) -> None:
    """Given a repository test in the image, when `python3 -m pytest` runs as the test command,
    then a passing suite is OK and a failing one FAILED, even when the command ends `; exit 0`."""
    traj = tid()
    tests = "def test_one():\n    assert 1 + 1 == 2\n\ndef test_two():\n    assert {x}\n"
    ok(
        box.run(
            traj,
            None,
            image=python_image,
            files={"tests/test_x.py": tests.format(x="True")},
            test_command="python3 -m pytest -q tests",
            new_sandbox=True,
        )
    )
    box.run(traj, "true", image=python_image, files={"tests/test_x.py": tests.format(x="False")})
    res = box.run(traj, None, image=python_image, test_command="python3 -m pytest -q tests; exit 0")
    assert res.status is ActionStatus.FAILED, res


def test_an_elastic_suite_runs_on_the_image_pytest_without_xdist(box: Box, python_image: str) -> None:
    """Given 6 repository tests (one failing) and an image whose pytest has no xdist, when `pytest`
    runs on 2 cores, then every test has its outcome and the verdict is FAILED."""
    traj = tid()
    files = {f"tests/test_{i}.py": f"def test_a{i}():\n    assert {i} != 3\n" for i in range(6)}
    probe = "python3 -c 'import xdist' 2>/dev/null || echo no-xdist"
    res = ok(box.run(traj, probe, image=python_image, files=files, new_sandbox=True))
    assert res.stdout == "no-xdist\n"
    res = box.run(traj, None, image=python_image, test_command="pytest -q tests", cores=(0, 1))
    assert res.status is ActionStatus.FAILED, res
    outcomes = sorted((t.name, t.passed) for t in res.tests)
    assert outcomes == [(f"tests/test_{i}.py::test_a{i}", i != 3) for i in range(6)], outcomes


FORCE_PASS = (
    "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
    "    out = yield\n    out.get_result().outcome = 'passed'\n"
)
HIDDEN = "from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def test_grade_ignores_planted_test_files_even_after_an_eviction(box: Box, python_image: str) -> None:
    """Given a trajectory that planted a conftest forcing every test to pass and rewrote the test
    module, when it is graded with the hidden tests, then its bug still FAILS (the grade runs the
    image plus its source changes only); fixed, it is OK, also from its kept (evicted) files."""
    traj = tid()
    planted = {
        "calc.py": "def add(a, b):\n    return a - b\n",
        "conftest.py": FORCE_PASS,
        "tests/test_calc.py": "def test_add():\n    assert True\n",
    }
    ok(box.run(traj, "true", image=python_image, files=planted, sandbox_gen="g1", new_sandbox=True))
    grade = {
        "image": python_image,
        "files": {"tests/test_calc.py": HIDDEN},
        "grade": True,
        "test_command": "python3 -m pytest -q tests",
    }
    res = box.pool.grade(traj, ExecRequest(language="bash", code=None, **grade))
    assert res.status is ActionStatus.FAILED, res
    ok(box.run(traj, "true", image=python_image, files={"calc.py": "def add(a, b):\n    return a + b\n"}))
    assert box.pool.grade(traj, ExecRequest(language="bash", code=None, **grade)).status is ActionStatus.OK
    box.pool.close_trajectory(traj, "g1", keep_files=True)
    box.wait_kept(traj, python_image)
    res = box.pool.grade(traj, ExecRequest(language="bash", code=None, **grade))
    assert res.status is ActionStatus.OK, res
    box.pool.close_trajectory(traj)


# ---- 2. files and the root ----------------------------------------------------------------------


def test_files_persist_and_only_the_workdir_and_tmp_are_the_users(box: Box) -> None:
    """Given a trajectory, when actions write, then its files persist across actions in the
    WORKDIR (the user's), /tmp is a tmpfs, and the image's system directories refuse writes."""
    traj = tid()
    ok(box.run(traj, "mkdir -p src && echo kept > src/a.txt && echo t > /tmp/t", new_sandbox=True))
    res = ok(box.run(traj, "cat src/a.txt /tmp/t; stat -c '%u %a' . src; cat /proc/mounts"))
    lines = res.stdout.splitlines()
    assert lines[:4] == ["kept", "t", "10001 755", "10001 755"], lines[:4]
    tmp = [line.split() for line in lines[4:] if line.split()[1:2] == ["/tmp"]]
    assert tmp and tmp[-1][2] == "tmpfs", lines[4:]
    res = box.run(traj, "touch /usr/evil; touch /usr/bin/evil; touch /etc/evil; touch /evil; echo done")
    assert res.stderr.count("Permission denied") == 4 and res.stdout == "done\n", res


# ---- 3. limits --------------------------------------------------------------------------------


def alive_commands(box: Box, traj: str) -> list[str]:
    """The command names of the live processes in `traj`'s sandbox (the looking shell's too)."""
    return [line.split(" ", 1)[1] for line in ok(box.run(traj, PROCS)).stdout.splitlines()]


def test_timeout_kills_the_tree_and_the_sandbox_serves_on(box: Box) -> None:
    traj = tid()
    res = box.run(traj, "sleep 100 & sleep 100; wait", timeout_s=1, new_sandbox=True)
    assert res.status is ActionStatus.TIMEOUT, res
    assert "sleep" not in alive_commands(box, traj)


def test_fork_bomb_hits_the_pids_limit(box: Box) -> None:
    traj = tid()
    res = box.run(traj, ":(){ :|:& };:; sleep 2", timeout_s=5, new_sandbox=True)
    assert res.status is ActionStatus.PIDS_LIMIT, res
    assert "bash" in alive_commands(box, traj)


def test_memory_and_output_limits(box: Box, python_image: str) -> None:
    traj = tid()
    grow = "a = []\nwhile True:\n    a.append(bytearray(1 << 20))\n"
    res = box.run(
        traj, grow, image=python_image, language="python", memory_mb=128, timeout_s=20, new_sandbox=True
    )
    assert res.status is ActionStatus.MEMORY_LIMIT, res
    res = box.run(
        traj, "while True:\n    print('y' * 1000)\n", image=python_image, language="python", timeout_s=20
    )
    assert res.status is ActionStatus.OUTPUT_LIMIT, res
    assert len(res.stdout.encode()) == SMALL_LIMITS["max_output_bytes"]


def test_no_network_but_lo(box: Box, python_image: str) -> None:
    code = (
        "import socket\nprint(sorted(n for _, n in socket.if_nameindex()))\n"
        "try:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n    print('OPEN')\n"
        "except OSError:\n    print('blocked')\n"
    )
    res = ok(box.run(tid(), code, image=python_image, language="python", new_sandbox=True))
    assert res.stdout == "['lo']\nblocked\n", res.stdout


def test_the_user_cannot_signal_pid1(box: Box) -> None:
    traj = tid()
    res = box.run(traj, "kill -9 1; kill -TERM 1; kill -9 -1; echo still-here", new_sandbox=True)
    assert "Operation not permitted" in res.stderr, res
    assert ok(box.run(traj, "echo alive")).stdout == "alive\n"


def test_user_code_in_an_image_runs_under_seccomp(box: Box, python_image: str) -> None:
    """Given the image's Python, when user code tries unshare(CLONE_NEWUSER), clone3 and mount,
    then each fails, and the process has seccomp filtering and no new privileges."""
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
        "print('clone3', libc.syscall(435, 0, 0), ctypes.get_errno())\n"
        "print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print('seccomp', status['Seccomp'].strip(), status['NoNewPrivs'].strip())\n"
    )
    res = ok(box.run(tid(), code, image=python_image, language="python", new_sandbox=True))
    out = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    assert out["unshare"] == "-1 1" and out["clone3"] == "-1 38" and out["mount"].startswith("-1 "), out
    assert out["seccomp"] == "2 1", out


FILL = "printf '%*s' 24000000 '' > {}"


def test_filling_the_disk_in_an_image_is_a_disk_limit(box: Box) -> None:
    """Given 16 MiB quotas, when an action writes 24 MB to /tmp (both backends) or to the
    workdir (the namespace backend's layer, a size-limited tmpfs; Docker's writable layer is
    the engine's, bounded only where its storage driver takes a size), then DISK_LIMIT, and
    the trajectory's earlier files stay."""
    traj = tid()
    ok(box.run(traj, "echo keep > old.txt", new_sandbox=True))
    res = box.run(traj, FILL.format("/tmp/fill"), timeout_s=30)
    assert res.status is ActionStatus.DISK_LIMIT, res
    if box.backend == "namespace":
        res = box.run(traj, FILL.format("big"), timeout_s=30)
        assert res.status is ActionStatus.DISK_LIMIT, res
    assert ok(box.run(traj, "cat old.txt")).stdout == "keep\n"


# ---- 4. eviction ------------------------------------------------------------------------------


def test_eviction_keeps_files_not_processes(box: Box) -> None:
    """Given a trajectory evicted with its files kept, when its next action runs (in the next
    generation), then its files are there, `kept_files` and no reset; its session's shell (a
    process) is gone. A plain close then deletes them."""
    traj = tid()
    ok(box.run(traj, "echo v1 > f.txt; export FOO=1", session=True, sandbox_gen="g1", new_sandbox=True))
    box.pool.close_trajectory(traj, "g1", keep_files=True)
    box.wait_kept(traj, TINY)
    res = ok(box.run(traj, "cat f.txt; echo ${FOO:-unset}", session=True, sandbox_gen="g2"))
    assert res.stdout == "v1\nunset\n" and res.kept_files and not res.sandbox_reset, res
    box.pool.close_trajectory(traj, "g2")
    res = box.run(traj, "cat f.txt", sandbox_gen="g3", new_sandbox=True)
    assert res.status is ActionStatus.FAILED and not res.kept_files, res


def test_close_while_evicted_deletes_the_kept_files(box: Box) -> None:
    traj = tid()
    ok(box.run(traj, "echo v1 > f.txt", sandbox_gen="g1", new_sandbox=True))
    box.pool.close_trajectory(traj, "g1", keep_files=True)
    box.wait_kept(traj, TINY)
    box.pool.close_trajectory(traj)
    assert box.pool.images.kept_image(traj) is None
    res = box.run(traj, "cat f.txt", sandbox_gen="g2", new_sandbox=True)
    assert res.status is ActionStatus.FAILED and not res.kept_files, res


def test_an_action_right_after_an_eviction_keeps_the_files(box: Box) -> None:
    """Given an eviction whose teardown runs in the background, when the trajectory's next action
    comes at once, then it waits for the kept layer and resumes its files."""
    traj = tid()
    ok(box.run(traj, "echo v1 > f.txt", sandbox_gen="g1", new_sandbox=True))
    box.pool.close_trajectory(traj, "g1", keep_files=True)
    res = box.run(traj, "cat f.txt", sandbox_gen="g2")
    assert res.stdout == "v1\n" and res.kept_files and not res.sandbox_reset, res


# ---- 5. fork ----------------------------------------------------------------------------------


def test_fork_copies_the_files_and_the_copies_are_independent(box: Box) -> None:
    parent, f1, f2 = tid(), tid(), tid()
    ok(box.run(parent, "mkdir -p d && echo base > d/x", new_sandbox=True))
    assert box.pool.fork(parent, [f1, f2]) >= 0
    res = ok(box.run(f1, "cat d/x; echo f1 > d/x; echo only-f1 > y", new_sandbox=True))
    assert res.stdout == "base\n" and res.kept_files and not res.sandbox_reset, res
    res = ok(box.run(f2, "cat d/x; ls d; [ -e y ] || echo no-y", new_sandbox=True))
    assert res.stdout.split() == ["base", "x", "no-y"], res
    ok(box.run(parent, "echo parent > d/x"))
    assert ok(box.run(f1, "cat d/x y")).stdout == "f1\nonly-f1\n"
    assert ok(box.run(f2, "cat d/x")).stdout == "base\n"
    for t in (parent, f1, f2):
        box.pool.close_trajectory(t)


# ---- 6. bad images ----------------------------------------------------------------------------


def test_another_image_later_is_rejected_naming_both(box: Box, python_image: str) -> None:
    traj = tid()
    ok(box.run(traj, "echo", new_sandbox=True))
    res = box.run(traj, "echo", image=python_image)
    assert res.status is ActionStatus.REJECTED and TINY in res.detail and python_image in res.detail, res
    ok(box.run(traj, "echo still"))  # the trajectory is unharmed


def test_unknown_image_is_rejected_naming_it_and_the_sources(box: Box) -> None:
    res = box.run(tid(), "echo", image="tangram-test/nope:9", new_sandbox=True)
    assert res.status is ActionStatus.REJECTED and "tangram-test/nope:9" in res.detail, res
    where = "Docker engine" if box.backend == "docker" else "OCI dir"
    assert where in res.detail, res.detail


@pytest.mark.parametrize("box", ["namespace"], indirect=True)  # an engine checks its own layers
def test_a_corrupt_layer_is_an_error_and_others_are_served(box: Box) -> None:
    """Given an image whose layer blob has flipped bytes, when an action names it, then ERROR
    with a detail saying which blob did not match, and other trajectories run on."""
    res = box.run(tid(), "echo", image=CORRUPT, new_sandbox=True)
    assert res.status is ActionStatus.ERROR and CORRUPT in res.detail and "digest" in res.detail, res
    assert ok(box.run(tid(), "echo fine", new_sandbox=True)).stdout == "fine\n"


def test_a_failed_image_is_not_retried_in_the_background(box: Box, caplog: pytest.LogCaptureFixture) -> None:
    """Given an unknown (Docker) or corrupt (namespace) image, when an action names it, then no
    ready sandboxes of it are started in the background afterwards."""
    image = CORRUPT if box.backend == "namespace" else "tangram-test/nope:8"
    with caplog.at_level(logging.WARNING):
        res = box.run(tid(), "echo", image=image, new_sandbox=True)
        assert res.status in (ActionStatus.ERROR, ActionStatus.REJECTED), res
        time.sleep(3)
    failures = [r for r in caplog.records if "ready sandbox failed" in r.getMessage()]
    assert not failures, [r.getMessage() for r in failures]


# ---- 7. disk ----------------------------------------------------------------------------------


def du_bytes(path: Path) -> int:
    """Bytes on disk under `path` (`du`: hard links once, no other file systems)."""
    out = subprocess.run(["du", "-sxB1", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


@pytest.mark.parametrize("box", ["namespace"], indirect=True)  # Docker's layers are the engine's
def test_trajectories_of_one_image_share_one_copy(box: Box) -> None:
    """Given 8 live trajectories of one image, each writing its own amount, then the store still
    holds one copy of the image (its disk use unchanged), and each trajectory's layer holds only
    what it wrote."""
    images_dir = box.pool.images.store.root / "images"
    ok(box.run(tid(), "echo", new_sandbox=True))  # the image is in the store now
    before = du_bytes(images_dir)
    trajs = [tid() for _ in range(8)]
    sizes = [(i + 1) * 100_000 for i in range(8)]

    def write(i: int) -> Any:
        code = f"printf '%*s' {sizes[i]} '' > blob; stat -c %s blob"
        return box.run(trajs[i], code, new_sandbox=True, cores=(i % 2,))

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(write, range(8)))
    try:
        assert [ok(r).stdout for r in results] == [f"{n}\n" for n in sizes]
        assert abs(du_bytes(images_dir) - before) < 64 << 10, (before, du_bytes(images_dir))
        image_bytes = box.pool.images.store.usage()["images"]
        for traj, n in zip(trajs, sizes, strict=True):
            layer = box.pool._handles[traj].layer
            used = layer.used_bytes()
            assert n <= used <= n + (256 << 10) < image_bytes, (traj, n, used, image_bytes)
            assert du_bytes(layer.upper) <= n + (64 << 10)
    finally:
        for traj in trajs:
            box.pool.close_trajectory(traj)


# ---- 9. a full store (namespace) --------------------------------------------------------------


def small_store_pool(images: Images, store: Path, store_mb: int) -> Any:
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.common.errors import SandboxError
    from tangram_celery.sandbox import open_sandbox

    cfg = {"backend": "namespace", "namespace_launcher": "builtin", **SMALL_LIMITS, "prewarm": 0}
    cfg["images"] = {**images_config(images, store), "store_mb": store_mb, "prewarm": 0}
    try:
        return open_sandbox(SandboxConfig.model_validate(cfg))
    except SandboxError as e:
        unavailable(f"namespace sandbox backend unavailable: {e}")


def test_a_store_too_small_for_the_image_is_an_error(
    image_layout: Images, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a 1 MiB store budget, when an action names the 5 MB image, then ERROR naming the
    store's budget setting, with a log line, and the pool serves host-toolchain actions on."""
    pool = small_store_pool(image_layout, tmp_path / "store", 1)
    try:
        with caplog.at_level(logging.ERROR):
            res = pool.run(tid(), ExecRequest(language="bash", code="echo", image=TINY, new_sandbox=True))
        assert res.status is ActionStatus.ERROR and "is full" in res.detail and "store_mb" in res.detail, res
        assert any("is full" in r.getMessage() for r in caplog.records)
        res = pool.run(tid(), ExecRequest(language="bash", code="echo host", new_sandbox=True))
        assert (res.status, res.stdout) == (ActionStatus.OK, "host\n"), res
    finally:
        pool.close()


def test_a_kept_layer_that_does_not_fit_the_store_is_dropped_and_said(
    image_layout: Images, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a store budget 1 MiB above the image, when a trajectory that wrote 3 MB is evicted,
    then its layer is dropped with a log line, and its next action starts afresh: a reset, with
    the reason in its detail."""
    size_mb = -(-image_layout.tars[TINY].stat().st_size // (1 << 20))  # about its unpacked size
    pool = small_store_pool(image_layout, tmp_path / "store", size_mb + 1)
    traj = tid()
    write = "printf '%*s' 3000000 '' > blob"
    try:
        res = pool.run(traj, ExecRequest("bash", write, image=TINY, sandbox_gen="g1", new_sandbox=True))
        assert res.status is ActionStatus.OK, res
        with caplog.at_level(logging.WARNING):
            pool.close_trajectory(traj, "g1", keep_files=True)
            deadline = time.monotonic() + 20
            while not any("dropped" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "no log line for the dropped layer"
                time.sleep(0.05)
        res = pool.run(traj, ExecRequest("bash", "ls", image=TINY, sandbox_gen="g2"))
        assert res.status is ActionStatus.OK and "blob" not in res.stdout, res
        assert res.sandbox_reset and not res.kept_files and "did not fit" in res.detail, res
    finally:
        pool.close()
