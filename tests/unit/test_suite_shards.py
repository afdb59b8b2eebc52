"""Sharded pytest suites (no xdist): the rewrite, the verdict's coverage rule, and the real
bootstrap's launcher on this interpreter's pytest."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_runner import suite
from tangram_runner.suite import Channel, rewrite, verdict

RUNNER_DIR = os.path.dirname(os.path.abspath(suite.__file__))
BOOT = "/img/python3 -E -s /r/pytest_boot.py --tangram-fd 3 --tangram-path :"
HOST = "/usr/bin/python3 -E -s /r/pytest_boot.py --tangram-fd 3 --tangram-path /opt/tangram/site"


@pytest.mark.parametrize(
    ("cmd", "dop", "expected"),
    [
        ("pytest -q", 4, f"{BOOT} --tangram-shards 4 -q"),
        ("cd /repo && python3 -m pytest tests", 2, f"cd /repo && {BOOT} --tangram-shards 2 tests"),
        ("pytest a; pytest b", 64, f"{BOOT} --tangram-shards 8 a; {BOOT} --tangram-shards 8 b"),
        ("pytest -q", 1, f"{BOOT} -q"),
        ("pytest -n 3 -q", 4, f"{BOOT} -n 3 -q"),
    ],
)
def test_pytest_on_an_images_python_runs_in_shards(cmd: str, dop: int, expected: str) -> None:
    """Given a test command on an image's Python, when rewritten for DoP > 1, then the bootstrap
    launches min(DoP, MAX_SHARDS) shards itself (no xdist); DoP 1, or an `-n` of the command's
    own, adds nothing."""
    assert rewrite(cmd, dop, "/r", [], "/img/python3", image=True) == expected


def test_host_toolchain_keeps_xdist_and_no_tools_dir_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the host's interpreter with the tools directory, then `-n K` as before; without a
    tools directory (xdist not guaranteed), shards."""
    monkeypatch.setattr("sys.executable", "/usr/bin/python3")
    assert rewrite("pytest -q", 4, "/r", ["/opt/tangram/site"]) == f"{HOST} -n 4 -q"
    bare = "/usr/bin/python3 -E -s /r/pytest_boot.py --tangram-fd 3 --tangram-path :"
    assert rewrite("pytest -q", 4, "/r", []) == f"{bare} --tangram-shards 4 -q"


@pytest.fixture
def channel() -> Iterator[Channel]:
    ch = Channel()
    yield ch
    ch.close()


def shard_session(
    ch: Channel, index: int, tests: list[str], *, count: int = 2, total: int = 4, run: str = "r1", **over: Any
) -> None:
    """One shard's complete session: its share `tests` of a run of `total` tests, all passing."""
    s = socket.socket(fileno=os.dup(ch.child_fd))
    s.send(b"hello")
    ch.on_readable()
    nonce = s.recv(64).decode()
    shard = {"event": "shard", "run": run, "index": index, "count": count, "total": total, "digest": "d"}
    evs: list[dict[str, Any]] = [{**shard, **over}, {"event": "collected", "n": len(tests)}]
    evs += [
        {"event": "report", "nodeid": t, "when": "call", "outcome": "passed", "xfail": False} for t in tests
    ]
    for ev in [*evs, {"event": "finish", "exitstatus": 0}]:
        s.send(json.dumps({"nonce": nonce, **ev}).encode())
    ch.on_readable()
    s.close()


def test_shards_that_cover_the_run_exactly_once_pass(channel: Channel) -> None:
    """Given shards 0 and 1 of 2 that ran disjoint halves of the 4 tests, then passed; a shard
    with no test (fewer tests than shards) is fine, and user deselection counts once."""
    shard_session(channel, 0, ["t::0", "t::2"])
    shard_session(channel, 1, ["t::1", "t::3"])
    v = verdict(channel, 0)
    assert v["passed"] and v["collected"] == 4, v
    ch = Channel()
    try:
        shard_session(ch, 0, ["t::0"], count=3, total=1)
        shard_session(ch, 1, [], count=3, total=1)
        shard_session(ch, 2, [], count=3, total=1)
        for s in ch.sessions.values():
            s.deselected = 5
        v = verdict(ch, 0)
        assert v["passed"] and v["deselected"] == 5, v
    finally:
        ch.close()


@pytest.mark.parametrize(
    ("sessions", "why"),
    [
        ([(0, ["t::0", "t::2"], {})], "shard(s) [1] of 2 sent no report"),
        ([(0, ["t::0", "t::2"], {}), (1, ["t::1"], {})], "the shards ran 3 of 4"),
        (
            [(0, ["t::0", "t::2"], {}), (1, ["t::1", "t::3"], {"digest": "other"})],
            "collected different tests",
        ),
        ([(0, ["t::0", "t::2"], {}), (1, ["t::1", "t::3"], {"total": 5})], "collected different tests"),
        ([(0, ["t::0", "t::1"], {}), (1, ["t::1", "t::3"], {})], "a test ran in two shards: t::1"),
        ([(0, ["t::0", "t::2"], {}), (0, ["t::1", "t::3"], {})], "shard(s) [1] of 2"),
        ([(0, [], {"total": 0}), (1, [], {"total": 0})], "no test was collected"),
    ],
    ids=["missing-shard", "dropped-tests", "other-digest", "other-total", "twice", "same-index", "none"],
)
def test_shards_that_do_not_cover_the_run_fail(
    channel: Channel, sessions: list[tuple[int, list[str], dict[str, Any]]], why: str
) -> None:
    """Given shard sessions that each passed but miss a shard, drop a test, disagree on what was
    collected, run a test twice or collected nothing, then not passed, saying why."""
    for index, tests, over in sessions:
        shard_session(channel, index, tests, **over)
    v = verdict(channel, 0)
    assert not v["passed"] and why in v["detail"], v


SUITE = """
import os
import pytest

@pytest.mark.parametrize("i", range(7))
def test_n(i):
    assert i >= 0
"""


def run_boot(ch: Channel, workdir: Path, *args: str) -> int:
    """The real bootstrap on this interpreter, reporting on `ch`; its exit status."""
    # this environment's pytest as the tools directory (and its stdlib: it may not be under /usr)
    site = ":".join(
        [*(p for p in sys.path if p.startswith(sys.base_prefix)), sysconfig.get_paths()["purelib"]]
    )
    argv = [sys.executable, "-E", "-s", os.path.join(RUNNER_DIR, "pytest_boot.py")]
    argv += ["--tangram-fd", str(ch.child_fd), "--tangram-path", site, *args, "-q", "-p", "no:cacheprovider"]
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # this venv's plugins: not needed, slow
    proc = subprocess.Popen(argv, cwd=workdir, pass_fds=(ch.child_fd,), stdout=subprocess.PIPE, env=env)
    while proc.poll() is None:
        if select.select([ch.sock], [], [], 0.05)[0]:
            ch.on_readable()
    out = proc.communicate()[0]
    ch.on_readable()
    assert b"tangram: shard" in out or proc.returncode != 0, out
    return proc.returncode


@pytest.mark.parametrize(
    ("body", "passed", "why"),
    [
        ("", True, ""),
        ("\ndef test_bad():\n    assert False\n", False, "collected tests passed"),
        ("\n@pytest.mark.parametrize('j', [1])\ndef test_z(j):\n    os._exit(0)\n", False, "final report"),
    ],
    ids=["pass", "one-fails", "shard-exits-early"],
)
def test_the_bootstrap_runs_k_shard_sessions(
    channel: Channel, tmp_path: Path, body: str, passed: bool, why: str
) -> None:
    """Given a suite of 7 tests (plus a failing one, or one that ends its process), when the
    bootstrap runs it in 3 shards, then 3 sessions report disjoint shares that cover it, and the
    suite passes only when every test passed in a shard that finished."""
    (tmp_path / "test_s.py").write_text(textwrap.dedent(SUITE) + body)
    code = run_boot(channel, tmp_path, "--tangram-shards", "3")
    v = verdict(channel, code)
    assert len(channel.sessions) == 3
    assert v["passed"] is passed and why in v["detail"], v
    if passed:
        assert (
            code == 0
            and v["collected"] == 7
            and sorted(t["name"] for t in v["tests"]) == [f"test_s.py::test_n[{i}]" for i in range(7)]
        )
        shares = sorted(s.collected or 0 for s in channel.sessions.values())
        assert shares == [2, 2, 3]


def test_a_shard_with_no_test_exits_0(channel: Channel, tmp_path: Path) -> None:
    """Given one test and 2 shards, then the second shard runs nothing, exits 0 (not pytest's
    "no tests collected"), and the suite passes."""
    (tmp_path / "test_one.py").write_text("def test_only():\n    pass\n")
    code = run_boot(channel, tmp_path, "--tangram-shards", "2")
    v = verdict(channel, code)
    assert code == 0 and v["passed"] and v["collected"] == 1 and len(channel.sessions) == 2, v
