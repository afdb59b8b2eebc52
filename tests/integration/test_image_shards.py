"""Elastic pytest suites in an image without pytest-xdist (issue 36, item 2): on 2 cores, the
test command's `pytest` runs as 2 shards of the harness's own on the image's Python and pytest
(Debian bookworm's 7.2), judged on the report channel: every shard must finish and pass, and
together they must run every collected test exactly once.

Both backends (namespace first); the image is `tests/fixtures/images.py`'s `python_image` (mmdebstrap, cached;
skipped without mmdebstrap or the Debian archive unless CI is set)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox import ExecRequest
from tangram_celery.sandbox.base import ExecResult
from tests.fixtures.images import Images, images_config, open_image_pool

pytestmark = pytest.mark.slow

SUITE = "import pytest\n\n\n@pytest.mark.parametrize('i', range(20))\ndef test_n(i):\n    assert i * i >= 0\n"
COMMAND = "python3 -m pytest -q -p no:cacheprovider tests"


@pytest.fixture(scope="module", params=["namespace", "docker"])
def box(
    request: pytest.FixtureRequest,
    image_layout: Images,
    python_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:

    cfg: dict[str, Any] = {"prewarm": 0, "backend": request.param}
    if request.param == "namespace":
        cfg["images"] = images_config(image_layout, Path(tmp_path_factory.mktemp("store")))
    else:
        cfg["docker_host"] = request.getfixturevalue("image_engine")
    yield from open_image_pool(request.param, cfg)


def suite(box: Any, python_image: str, extra: str = "", cores: tuple[int, ...] = (0, 1)) -> ExecResult:
    """The 20-test suite (plus `extra` test code) as a test command in a new trajectory."""
    tid = f"sh-{uuid.uuid4().hex[:10]}"
    files = {"tests/test_s.py": SUITE + extra}
    req = ExecRequest(
        language="bash",
        code=None,
        files=files,
        test_command=COMMAND,
        timeout_s=120.0,
        cores=cores,
        image=python_image,
    )
    try:
        return box.run(tid, req)
    finally:
        box.close_trajectory(tid)


def test_the_image_has_no_xdist(box: Any, python_image: str) -> None:
    tid = f"sh-{uuid.uuid4().hex[:10]}"
    req = ExecRequest(language="bash", code="python3 -c 'import xdist'", image=python_image, cores=(0,))
    res = box.run(tid, req)
    box.close_trajectory(tid)
    assert res.exit_code != 0 and "No module named 'xdist'" in res.stderr, res


def test_a_suite_on_two_cores_runs_in_two_shards_and_passes(box: Any, python_image: str) -> None:
    """Given 20 passing tests and 2 cores, then OK: two pytest sessions (two summaries), 20
    tests each run once."""
    res = suite(box, python_image)
    assert res.status is ActionStatus.OK, res
    assert "tangram: shard 2 of 2" in res.stdout and res.stdout.count("10 passed") == 2, res.stdout
    assert sorted(t.name for t in res.tests) == sorted(f"tests/test_s.py::test_n[{i}]" for i in range(20))
    assert all(t.passed for t in res.tests)


def test_one_failing_test_fails_the_sharded_suite(box: Any, python_image: str) -> None:
    res = suite(box, python_image, "\n\ndef test_bad():\n    assert False\n")
    assert res.status is ActionStatus.FAILED, res
    assert [t.name for t in res.tests if not t.passed] == ["tests/test_s.py::test_bad"], res.tests


@pytest.mark.parametrize(
    "end", ["os.kill(os.getpid(), signal.SIGKILL)", "os._exit(0)"], ids=["killed", "exits-0"]
)
def test_a_shard_that_ends_early_fails_the_suite(box: Any, python_image: str, end: str) -> None:
    """Given a test that kills its own shard (or ends it with status 0) before the shard's final
    report, then FAILED, although every report that came in was a pass."""
    res = suite(box, python_image, f"\n\ndef test_end():\n    import os, signal\n    {end}\n")
    assert res.status is ActionStatus.FAILED, res
    assert "final report" in res.detail, res.detail
