"""Limits inside container images, on both backends (`image_box`, tests/fixtures/images.py):
time, memory, pids, output, network, signals, seccomp and disk quotas hold as in host
sandboxes; on the namespace backend trajectories of one image share one copy of it, and the
image store's budget gives clear statuses."""

from __future__ import annotations

import logging
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox import ExecRequest
from tests.fixtures.common import unavailable
from tests.fixtures.docker import SMALL_LIMITS
from tests.fixtures.images import TINY, ImageBox, Images, images_config

PROCS = 'for p in /proc/[0-9]*; do read -r c < "$p/comm" && echo "${p#/proc/} $c"; done'


def tid() -> str:
    return "i-" + uuid.uuid4().hex[:10]


def ok(res: Any) -> Any:
    assert res.status is ActionStatus.OK, res
    return res


# ---- 3. limits --------------------------------------------------------------------------------


def alive_commands(image_box: ImageBox, traj: str) -> list[str]:
    """The command names of the live processes in `traj`'s sandbox (the looking shell's too)."""
    return [line.split(" ", 1)[1] for line in ok(image_box.run(traj, PROCS)).stdout.splitlines()]


def test_timeout_kills_the_tree_and_the_sandbox_serves_on(image_box: ImageBox) -> None:
    traj = tid()
    res = image_box.run(traj, "sleep 100 & sleep 100; wait", timeout_s=1, new_sandbox=True)
    assert res.status is ActionStatus.TIMEOUT, res
    assert "sleep" not in alive_commands(image_box, traj)


def test_fork_bomb_hits_the_pids_limit(image_box: ImageBox) -> None:
    traj = tid()
    res = image_box.run(traj, ":(){ :|:& };:; sleep 2", timeout_s=5, new_sandbox=True)
    assert res.status is ActionStatus.PIDS_LIMIT, res
    assert "bash" in alive_commands(image_box, traj)


def test_memory_and_output_limits(image_box: ImageBox, python_image: str) -> None:
    traj = tid()
    grow = "a = []\nwhile True:\n    a.append(bytearray(1 << 20))\n"
    res = image_box.run(
        traj, grow, image=python_image, language="python", memory_mb=128, timeout_s=20, new_sandbox=True
    )
    assert res.status is ActionStatus.MEMORY_LIMIT, res
    res = image_box.run(
        traj, "while True:\n    print('y' * 1000)\n", image=python_image, language="python", timeout_s=20
    )
    assert res.status is ActionStatus.OUTPUT_LIMIT, res
    assert len(res.stdout.encode()) == SMALL_LIMITS["max_output_bytes"]


def test_no_network_but_lo(image_box: ImageBox, python_image: str) -> None:
    """Only the sandbox's own loopback exists (no address outside it is ever a target here)."""
    code = (
        "import socket\nprint(sorted(n for _, n in socket.if_nameindex()))\n"
        "try:\n    socket.create_connection(('127.0.0.1', 9), timeout=2)\n    print('OPEN')\n"
        "except OSError:\n    print('blocked')\n"
    )
    res = ok(image_box.run(tid(), code, image=python_image, language="python", new_sandbox=True))
    assert res.stdout == "['lo']\nblocked\n", res.stdout


def test_the_user_cannot_signal_pid1(image_box: ImageBox) -> None:
    traj = tid()
    res = image_box.run(traj, "kill -9 1; kill -TERM 1; kill -9 -1; echo still-here", new_sandbox=True)
    assert "Operation not permitted" in res.stderr, res
    assert ok(image_box.run(traj, "echo alive")).stdout == "alive\n"


def test_user_code_in_an_image_runs_under_seccomp(image_box: ImageBox, python_image: str) -> None:
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
    res = ok(image_box.run(tid(), code, image=python_image, language="python", new_sandbox=True))
    out = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    assert out["unshare"] == "-1 1" and out["clone3"] == "-1 38" and out["mount"].startswith("-1 "), out
    assert out["seccomp"] == "2 1", out


FILL = "printf '%*s' 24000000 '' > {}"


def test_filling_the_disk_in_an_image_is_a_disk_limit(image_box: ImageBox) -> None:
    """Given 16 MiB quotas, when an action writes 24 MB to /tmp (both backends) or to the
    workdir (the namespace backend's layer, a size-limited tmpfs; Docker's writable layer is
    the engine's, bounded only where its storage driver takes a size), then DISK_LIMIT, and
    the trajectory's earlier files stay."""
    traj = tid()
    ok(image_box.run(traj, "echo keep > old.txt", new_sandbox=True))
    res = image_box.run(traj, FILL.format("/tmp/fill"), timeout_s=30)
    assert res.status is ActionStatus.DISK_LIMIT, res
    if image_box.backend == "namespace":
        res = image_box.run(traj, FILL.format("big"), timeout_s=30)
        assert res.status is ActionStatus.DISK_LIMIT, res
    assert ok(image_box.run(traj, "cat old.txt")).stdout == "keep\n"


# ---- 7. disk ----------------------------------------------------------------------------------


def du_bytes(path: Path) -> int:
    """Bytes on disk under `path` (`du`: hard links once, no other file systems)."""
    out = subprocess.run(["du", "-sxB1", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


@pytest.mark.parametrize("image_box", ["namespace"], indirect=True)  # Docker's layers are the engine's
def test_trajectories_of_one_image_share_one_copy(image_box: ImageBox) -> None:
    """Given 8 live trajectories of one image, each writing its own amount, then the store still
    holds one copy of the image (its disk use unchanged), and each trajectory's layer holds only
    what it wrote."""
    images_dir = image_box.pool.images.store.root / "images"
    ok(image_box.run(tid(), "echo", new_sandbox=True))  # the image is in the store now
    before = du_bytes(images_dir)
    trajs = [tid() for _ in range(8)]
    sizes = [(i + 1) * 100_000 for i in range(8)]

    def write(i: int) -> Any:
        code = f"printf '%*s' {sizes[i]} '' > blob; stat -c %s blob"
        return image_box.run(trajs[i], code, new_sandbox=True, cores=(i % 2,))

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(write, range(8)))
    try:
        assert [ok(r).stdout for r in results] == [f"{n}\n" for n in sizes]
        assert abs(du_bytes(images_dir) - before) < 64 << 10, (before, du_bytes(images_dir))
        image_bytes = image_box.pool.images.store.usage()["images"]
        for traj, n in zip(trajs, sizes, strict=True):
            layer = image_box.pool._handles[traj].layer
            used = layer.used_bytes()
            assert n <= used <= n + (256 << 10) < image_bytes, (traj, n, used, image_bytes)
            assert du_bytes(layer.upper) <= n + (64 << 10)
    finally:
        for traj in trajs:
            image_box.pool.close_trajectory(traj)


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
