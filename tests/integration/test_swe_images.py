"""SWE task images built here with no registry: a Debian base by mmdebstrap, PyPI sdists with an
injected bug, an OCI layout and images in a private Docker engine.

Slow the first time (mmdebstrap, about 30 s; pip downloads); everything is cached under
`$TANGRAM_CACHE/swe` (default ~/.cache/tangram/swe), so a second run only imports the cached base
into the fresh engine and builds two small layers on it.
"""

from __future__ import annotations

import json
import shutil
import socket
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.common import unavailable
from tests.fixtures.images import open_image_pool

pytestmark = pytest.mark.slow

TWO = ("inflection", "toolz")
CHEATS_ALL = ("edit-tests", "skip-conftest", "forge-conftest")


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


def _require_build_inputs(cache: Path) -> None:
    """mmdebstrap and the network, unless what they make is cached already."""
    from tangram_celery.common.pretend import pretend_missing
    from tangram_celery.swe.build import SUITE, base_key

    if not (cache / f"base-{SUITE}-{base_key()}.tar").exists():
        if shutil.which("mmdebstrap") is None or pretend_missing("mmdebstrap"):
            unavailable("mmdebstrap not installed (apt-get install mmdebstrap)")
        if not _reachable("deb.debian.org", 80):
            unavailable("the Debian archive (deb.debian.org) is not reachable")
    if not (cache / "sdists").exists() and not _reachable("pypi.org", 443):
        unavailable("PyPI is not reachable")


@pytest.fixture(scope="module")
def built(image_engine: str) -> Iterator[Any]:
    """Two task images, in the test cache's OCI layout and in the private engine (overlay2)."""
    from tangram_celery.swe.build import build, cache_dir
    from tangram_celery.swe.tasks import task

    cache = cache_dir()
    _require_build_inputs(cache)
    yield build([task(n) for n in TWO], cache=cache, docker_host=image_engine)


def _run(image_engine: str, image: str, script: str) -> tuple[int, str]:
    """Exit status and output of `bash -c script` in a fresh container of `image`, no network."""
    import docker

    client = docker.DockerClient(base_url=image_engine, timeout=300)
    try:
        box = client.containers.create(image, ["bash", "-c", script], network_mode="none")
        try:
            box.start()
            status = box.wait(timeout=300)
            return int(status["StatusCode"]), box.logs().decode(errors="replace")
        finally:
            box.remove(force=True)
    finally:
        client.close()


@pytest.mark.parametrize("name", TWO)
def test_hidden_tests_fail_on_the_bug_and_pass_after_the_fix(
    built: Any, image_engine: str, name: str
) -> None:
    """In the Docker image, the task's hidden tests fail as built and pass once the agent's fix
    (its bash edit) is applied: the bug is real and the fix is the only change needed."""
    from tangram_celery.swe.agent import edit_command
    from tangram_celery.swe.tasks import task

    t = task(name)
    code, out = _run(image_engine, t.image, f"cd /repo && {t.test_command}")
    assert code == 1 and " failed" in out, out
    code, out = _run(image_engine, t.image, f"set -e; cd /repo\n{edit_command(t.fix)}{t.test_command}")
    assert code == 0 and " passed" in out and "failed" not in out, out


def _sha256(path: Path) -> str:
    from tangram_celery.sandbox.oci import sha256_file

    return sha256_file(path)[0]


def test_the_oci_layout_is_valid(built: Any) -> None:
    """Every task ref of the layout's index leads to a manifest, config and layers whose blobs
    match their digests, the config's diff_ids are the layers', and the repository layer holds
    the buggy source at repo/."""
    from tangram_celery.swe.build import task_key
    from tangram_celery.swe.tasks import task

    layout: Path = built.layout
    assert json.loads((layout / "oci-layout").read_text())["imageLayoutVersion"] == "1.0.0"
    index = json.loads((layout / "index.json").read_text())
    refs = {m["annotations"]["org.opencontainers.image.ref.name"]: m for m in index["manifests"]}
    blob = lambda d: layout / "blobs" / "sha256" / d.partition(":")[2]  # noqa: E731
    for name in TWO:
        t = task(name)
        desc = refs[t.image]
        assert _sha256(blob(desc["digest"])) == desc["digest"]
        manifest = json.loads(blob(desc["digest"]).read_text())
        config = json.loads(blob(manifest["config"]["digest"]).read_text())
        assert _sha256(blob(manifest["config"]["digest"])) == manifest["config"]["digest"]
        assert config["config"]["WorkingDir"] == "/repo"
        layers = [la["digest"] for la in manifest["layers"]]
        assert len(layers) == 2 and all(_sha256(blob(d)) == d for d in layers)
        assert config["rootfs"]["diff_ids"] == layers  # plain tars: the diff_id is the digest
        assert layers[0] == _sha256(built.base)
        with tarfile.open(blob(layers[1])) as tf:
            src = tf.extractfile(f"repo/{t.bug.path}")
            assert src is not None and t.bug.new in src.read().decode()
        assert json.loads((layout / "tangram-swe-keys.json").read_text())[t.image] == task_key(t, built.base)


def test_a_second_build_reuses_everything(built: Any, image_engine: str) -> None:
    """Building again with the same inputs runs no mmdebstrap, download, layout write or docker
    build: every artifact is found by the key of its inputs."""
    from tangram_celery.swe.build import build, cache_dir
    from tangram_celery.swe.tasks import task

    lines: list[str] = []
    again = build([task(n) for n in TWO], cache=cache_dir(), docker_host=image_engine, log=lines.append)
    assert lines == []
    assert again.docker_images == built.docker_images
    assert again.base == built.base and again.layers == built.layers


# ---- end to end: the scripted trajectories in image sandboxes, on both backends ----------------


@pytest.fixture(scope="module", params=["namespace", "docker"])
def box(
    request: pytest.FixtureRequest, built: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """A sandbox pool of each backend that knows the task images: the namespace backend's image
    store reads the SWE layout; the Docker backend uses the engine the images were built in."""

    base: dict[str, Any] = {"prewarm": 0, "idle_ttl_s": 600}
    if request.param == "namespace":
        store = tmp_path_factory.mktemp("swe-store")
        images = {"store_dir": str(store), "docker": False, "oci_dirs": [str(built.layout)]}
        base |= {"backend": "namespace", "images": images}
    else:
        base |= {"backend": "docker", "docker_host": request.getfixturevalue("image_engine")}
    yield from open_image_pool(request.param, base)


def _runner(box: Any) -> Any:
    """A step runner on the sandbox pool directly: each action as the worker would hand it over."""
    from dataclasses import fields

    from tangram_celery.common.actions import CodeAction
    from tangram_celery.sandbox import ExecRequest

    names = [f.name for f in fields(ExecRequest) if f.name in CodeAction.model_fields]

    def run(action: CodeAction) -> Any:
        req = ExecRequest(**{n: getattr(action, n) for n in names}, cores=(0,))
        return (box.grade if action.grade else box.run)(action.trajectory_id, req)

    return run


@pytest.mark.parametrize("name", TWO)
def test_the_scripted_fix_earns_the_reward(box: Any, name: str) -> None:
    """The agent's trajectory in the task image: the tests fail before its edit and pass after,
    and the grade action (hidden tests, harness verdict) gives reward 1."""
    import uuid

    from tangram_celery.common.actions import ActionStatus
    from tangram_celery.swe.agent import run_trajectory
    from tangram_celery.swe.build import hidden_files
    from tangram_celery.swe.tasks import task

    t = task(name)
    tid = f"swe-{uuid.uuid4().hex[:8]}"
    out = run_trajectory(_runner(box), t, tid, hidden_files(t))
    try:
        r = out.results
        assert r["inspect"].status is ActionStatus.OK and f"def {t.function}" in r["inspect"].stdout, r[
            "inspect"
        ]
        assert r["reproduce"].exit_code == 1 and " failed" in r["reproduce"].stdout, r["reproduce"]
        assert r["edit"].status is ActionStatus.OK, r["edit"]
        assert r["verify"].status is ActionStatus.OK and " passed" in r["verify"].stdout, r["verify"]
        assert out.reward == 1.0, r["reward"]
    finally:
        box.close_trajectory(tid)


@pytest.mark.parametrize("cheat", ["edit-tests", "skip-conftest", "forge-conftest"])
def test_a_cheating_trajectory_earns_nothing(box: Any, cheat: str) -> None:
    """Edited test modules, a conftest.py that skips everything and one that forges passes make
    the trajectory's own test run look fine (or skipped), but its reward is 0."""
    import uuid

    from tangram_celery.swe.agent import run_trajectory
    from tangram_celery.swe.build import hidden_files
    from tangram_celery.swe.tasks import task

    t = task(TWO[0])
    tid = f"swe-{uuid.uuid4().hex[:8]}"
    out = run_trajectory(_runner(box), t, tid, hidden_files(t), kind=cheat)
    try:
        assert out.results["verify"].exit_code == 0, out.results["verify"]  # it fooled itself
        assert out.reward == 0.0, out.results["reward"]
    finally:
        box.close_trajectory(tid)


def test_the_swe_demo_rewards_each_trajectory_as_it_deserves(
    built: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tangram demo --workload swe` on the embedded default (namespace backend): nine scripted
    trajectories over the three tasks through the whole stack (client, scheduler, worker, image
    sandboxes): every bug is reproduced, every fix earns 1, no change and each cheat earn 0, and
    the summary gives pass rates, ACT and the queue/exec split."""
    import yaml

    from tangram_celery.common.config import default_config_path, load_config
    from tangram_celery.deploy import Deployment
    from tangram_celery.swe.build import build
    from tangram_celery.swe.demo import demo_config, run_swe_demo
    from tangram_celery.swe.tasks import TASKS
    from tests.fixtures.sandbox import require_sandbox

    build(TASKS, cache=built.base.parent, layout=built.layout)  # the third task, into the same layout
    raw = yaml.safe_load(default_config_path().read_text())
    raw["state_dir"] = str(tmp_path / "state")
    raw["broker"]["data_dir"] = str(tmp_path / "state" / "redis")
    raw["sandbox"] |= {"backend": "namespace", "images": {"store_dir": str(tmp_path / "store")}}
    require_sandbox(raw["sandbox"])
    src = tmp_path / "local.yaml"
    src.write_text(yaml.safe_dump(raw))
    path = demo_config(src, built.layout, tmp_path / "swe.yaml")
    dep = Deployment(load_config(path), path, with_flower=False)
    try:
        dep.start(progress=False)
        summary = run_swe_demo(dep.url, dep.cfg, trajectories=9)
    finally:
        dep.stop()
    out = capsys.readouterr().out
    assert summary.ok, out
    assert sorted(o.kind for o in summary.outcomes) == sorted(["fix"] * 3 + ["no-fix"] * 3 + list(CHEATS_ALL))
    assert all(o.results["reproduce"].exit_code == 1 for o in summary.outcomes), out
    for t in TASKS:
        assert f"{t.name}: pass rate 33% of 3" in out and "bug reproduced in 3/3" in out
    assert "rewards: every one as deserved" in out and "queueing" in out
