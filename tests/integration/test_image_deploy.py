"""Container images through a real deployment (Redis, scheduler, a CPU worker on the namespace
backend reading the test OCI layout, `tangram serve`): an image no node reports is refused at
submit, by the Python client (naming the nodes) and by the native HTTP API (400); a trajectory
in an image runs, keeps its files, and forks through the client and HTTP."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.fixtures.images import TINY, Images, images_config
from tests.fixtures.redis import deployment_config
from tests.fixtures.sandbox import require_sandbox

pytest.importorskip("fastapi", reason="the HTTP server needs the 'http' extra")

UNKNOWN = "tangram-test/nope:9"


@pytest.fixture
def image_deployment(tmp_path: Path, image_layout: Images) -> Iterator[Any]:
    """A deployment whose one CPU node (n0) runs namespace sandboxes of the test layout's
    images, with its HTTP server; started once its worker reported the images."""
    import redis

    from tangram_celery.common.config import load_config
    from tangram_celery.deploy import Deployment

    sandbox = {
        "backend": "namespace",
        "namespace_launcher": "builtin",
        "default_timeout_s": 10,
        "images": images_config(image_layout, tmp_path / "store"),
    }
    path = deployment_config(tmp_path, sandbox=sandbox)
    cfg = load_config(path)
    require_sandbox(cfg.sandbox.model_dump(mode="json"))
    dep = Deployment(cfg, path, with_flower=False, with_http=True)
    try:
        dep.start(progress=False)
        r = redis.Redis.from_url(dep.url)
        deadline = time.monotonic() + 60
        while TINY not in json.loads(r.hget("tangram:images", "n0") or "{}").get("fetchable", []):
            assert time.monotonic() < deadline, "the CPU worker did not report its images"
            time.sleep(0.2)
        r.close()
        yield dep
    finally:
        dep.stop()


def test_images_through_a_deployment(image_deployment: Any) -> None:
    """An unknown image is refused at submit by the client (naming the node checked) and by
    HTTP (400, nothing queued); the tiny image runs, keeps files across actions, and a fork
    (client and HTTP) starts new trajectories from them."""
    from tangram_celery import TangramClient
    from tangram_celery.common.errors import ActionRejected

    url = image_deployment.http_url + "/tangram/v1"
    client = TangramClient(image_deployment.url)
    try:
        bad = {"type": "code", "language": "bash", "code": "echo", "image": UNKNOWN, "trajectory_id": "d-bad"}
        with pytest.raises(ActionRejected) as refused:
            client.submit(bad)
        assert UNKNOWN in str(refused.value) and "n0" in str(refused.value)
        r = requests.post(url + "/actions", json=bad, timeout=60)
        assert r.status_code == 400 and UNKNOWN in r.text and "n0" in r.text, r.text

        def run(tid: str, code: str) -> Any:
            action = {"type": "code", "language": "bash", "code": code, "image": TINY, "trajectory_id": tid}
            return client.submit(action).result(120)

        res = run("d-1", "cat README; echo mine > f.txt")
        assert (res.status.value, res.stdout) == ("ok", "tiny image\n"), res
        res = run("d-1", "cat f.txt")
        assert (res.status.value, res.stdout) == ("ok", "mine\n"), res
        forks = client.fork("d-1", ids=["d-1a", "d-1b"])
        assert forks == ["d-1a", "d-1b"]
        res = run("d-1a", "cat f.txt; echo a > f.txt")
        assert (res.status.value, res.stdout) == ("ok", "mine\n"), res
        assert run("d-1b", "cat f.txt").stdout == "mine\n"
        r = requests.post(url + "/trajectories/d-1a/fork", json={"n": 1}, timeout=120)
        assert r.status_code == 200, r.text
        (child,) = r.json()["forks"]
        assert run(child, "cat f.txt").stdout == "a\n"
        for tid in ("d-1", "d-1a", "d-1b", child):
            client.close_trajectory(tid)
    finally:
        client.close()


BUGGY = "def add(a, b):\n    return a - b\n"
HIDDEN = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.mark.slow
def test_a_swe_like_round_trip(image_deployment: Any, python_image: str) -> None:
    """Through the client, in the Debian image: the repository's test fails, the agent's bash
    edit fixes it, and a grade with the hidden tests passes; a grade before the fix fails."""
    from tangram_celery import TangramClient

    client = TangramClient(image_deployment.url)
    base = {"type": "code", "language": "bash", "image": python_image, "trajectory_id": "swe-1"}
    tests = {"test_command": "python3 -m pytest -q tests", "code": None}
    grade = {**base, **tests, "grade": True, "files": {"tests/test_calc.py": HIDDEN}}
    try:
        files = {"calc.py": BUGGY, "tests/test_calc.py": HIDDEN}
        res = client.submit({**base, "code": "ls; cat calc.py", "files": files}).result(300)
        assert res.status.value == "ok" and "calc.py" in res.stdout, res
        res = client.submit({**base, **tests}).result(120)
        assert res.status.value == "failed" and not res.sandbox_reset, res
        assert client.submit(grade).result(120).status.value == "failed"
        fix = "cat > calc.py <<'PY'\ndef add(a, b):\n    return a + b\nPY"
        assert client.submit({**base, "code": fix}).result(120).status.value == "ok"
        res = client.submit({**base, **tests}).result(120)
        assert res.status.value == "ok", res
        res = client.submit(grade).result(120)
        assert res.status.value == "ok", res
        client.close_trajectory("swe-1")
    finally:
        client.close()
