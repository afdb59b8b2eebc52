"""Native endpoints, remote reward endpoints and the verl adapters against a live `tangram serve`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

pytest.importorskip("fastapi")

RULE = {"reward_models": [{"name": "exact", "backend": "rule", "rule": "exact-match"}]}
DOUBLE = "```python\nprint(int(input()) * 2)\n```"
TESTS = json.dumps({"inputs": ["1\n", "2\n", "3\n"], "outputs": ["2\n", "4\n", "6\n"]})


@pytest.mark.deploy(**RULE)
def test_native_endpoints(http_deployment: Any) -> None:
    """run_tests runs all cases in one action; actions can be submitted without waiting and
    polled; a trajectory keeps its files across calls until closed; API actions run; the
    OpenAPI schema is served."""
    url = http_deployment.http_url + "/tangram/v1"
    r = requests.post(
        url + "/run_tests",
        json={
            "code": "print(int(input()) * 2)",
            "cases": [{"stdin": "1", "expected_stdout": "2"}, {"stdin": "2", "expected_stdout": "5"}],
            "cpus": "1..2",
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["passed"], out["total"], out["status"]) == (1, 2, "failed")
    assert [c["passed"] for c in out["cases"]] == [True, False]

    r = requests.post(
        url + "/actions?wait=false", json={"type": "api", "api": "calc", "request": {"expr": "6*7"}}
    )
    assert r.status_code == 202, r.text
    action_id = r.json()["action_id"]
    r = requests.get(f"{url}/actions/{action_id}?wait_s=30")
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    assert requests.get(url + "/actions/nope").status_code == 404

    write = {"type": "code", "trajectory_id": "native-t1", "code": "open('keep.txt', 'w').write('kept')"}
    read = {"type": "code", "trajectory_id": "native-t1", "code": "print(open('keep.txt').read())"}
    assert requests.post(url + "/actions", json=write).json()["status"] == "ok"
    assert requests.post(url + "/actions", json=read).json()["stdout"] == "kept\n"
    sf = requests.post(
        http_deployment.http_url + "/run_code",
        json={"code": "print(open('keep.txt').read())", "language": "python", "trajectory_id": "native-t1"},
    ).json()
    assert sf["run_result"]["stdout"] == "kept\n" and sf["tangram"]["trajectory_id"] == "native-t1"
    assert requests.post(url + "/trajectories/native-t1/close").status_code == 202

    bad = requests.post(url + "/actions", json={"type": "reward", "model": "nope", "inputs": {}})
    assert bad.status_code == 400 and "unknown reward model" in bad.json()["detail"]
    ping = requests.get(http_deployment.http_url + "/v1/ping")
    assert ping.json() == "pong" and ping.headers["content-type"] == "application/json"  # as SandboxFusion
    caps = requests.get(http_deployment.http_url + "/v1/capabilities").json()
    assert {"python", "bash", "c"} <= set(caps["languages"]) and caps["reward_models"] == ["exact"]
    assert caps["languages_reported"] and caps["languages_by_node"]["n0"] == caps["languages"]
    assert "/run_code" in requests.get(http_deployment.http_url + "/openapi.json").json()["paths"]


@pytest.mark.deploy(**RULE)
def test_openrlhf_and_slime_reward_endpoints_share_one_scoring_path(http_deployment: Any) -> None:
    """OpenRLHF's and slime's remote-reward requests are scored by a rule verifier or by code
    tests (all cases of a problem in one action)."""
    base = http_deployment.http_url + "/tangram/v1"
    r = requests.post(
        base + "/openrlhf/exact",
        json={
            "query": ["Q: 2+2? A: 4", "Q: 2+2? A: 5"],
            "prompts": ["Q: 2+2? A:", "Q: 2+2? A:"],
            "labels": ["4", "4"],
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["rewards"] == [1.0, 0.0] and r.json()["scores"] == [1.0, 0.0]
    r = requests.post(
        base + "/openrlhf/code", json={"query": ["p" + DOUBLE], "prompts": ["p"], "labels": [TESTS]}
    )
    assert r.json()["rewards"] == [1.0] and r.json()["extra_logs"]["tangram_passed"] == [3.0]
    assert (
        requests.post(
            base + "/slime/exact", json={"prompt": "q", "response": "Paris", "label": "paris"}
        ).json()
        == 1.0
    )
    wrong = "```python\nprint(1)\n```"
    assert (
        requests.post(base + "/slime/code", json={"prompt": "q", "response": wrong, "label": TESTS}).json()
        == 0.0
    )
    assert requests.post(base + "/slime/nope", json={"response": "x"}).status_code == 400


def test_verl_adapters(http_deployment: Any) -> None:
    """verl's custom reward function (async and sync) scores a problem in one action, and the
    code tool keeps files across calls of one rollout (request_id)."""
    from tangram_celery.integrations import verl

    url = http_deployment.http_url
    sync = verl.compute_score_sync("codecontests", DOUBLE, TESTS, None, tangram_url=url)
    assert sync == {"score": 1.0, "passed": 3, "total": 3, "tangram_status": "ok"}
    half = verl.compute_score_sync("apps", "```python\nprint(2)\n```", TESTS, None, tangram_url=url)
    assert half["passed"] == 1 and abs(half["score"] - 1 / 3) < 1e-9
    assert asyncio.run(verl.compute_score("taco", DOUBLE, TESTS, None, tangram_url=url))["score"] == 1.0
    assert (
        verl.compute_score_sync("x", "no code", TESTS, None, tangram_url=url)["tangram_status"] == "no_code"
    )

    class AgentData:
        request_id = "rollout-7"

    tool = verl.CodeToolCore({"tangram_url": url})

    async def two_calls() -> tuple[str, str]:
        first, _ = await tool.run("i1", {"code": "open('f', 'w').write('x1')"}, agent_data=AgentData())
        second, _ = await tool.run("i2", {"code": "print(open('f').read())"}, agent_data=AgentData())
        return first, second

    _, second = asyncio.run(two_calls())
    assert "x1" in second


@pytest.mark.slow
@pytest.mark.deploy(http={"overload_status": 429})  # an overload answer is not a server error
def test_schema_fuzzing_finds_no_server_error(http_deployment: Any, tmp_path: Path) -> None:
    """schemathesis, driven by the served OpenAPI schema, gets no 5xx and no unanswered request
    from any endpoint (bounded: 15 examples per operation, 60 s: CI's 40 minutes on 2 cores)."""
    pytest.importorskip("schemathesis")
    st = [str(Path(sys.executable).parent / "st")]  # schemathesis' CLI, installed with it
    schema = http_deployment.http_url + "/openapi.json"
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            *st,
            "run",
            schema,
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "15",
            "--max-time",
            "60",
            "--workers",
            "2",
            "--phases",
            "examples,fuzzing",
            # a request may take its compile and run limits (10 s each by default) and a queue:
            # schemathesis' own 10 s would call an answer the server is still entitled to an error
            "--request-timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # schemathesis writes its cache (.schemathesis/) there
    )
    if proc.returncode != 0:  # the whole report (pytest shortens a long assertion message)
        print(proc.stdout, proc.stderr, sep="\n")
        # and the server's side of it: a 5xx is an exception the HTTP server logged
        log = Path(http_deployment.cfg.state_dir) / "logs" / "http.log"
        if log.exists():
            print("---- http.log ----", log.read_text(errors="replace")[-20000:], sep="\n")
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-2000:], time.monotonic() - t0)


def _verl_tools_without_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `verl.tools.base_tool` importable without torch and ray: the packages `verl` and
    `verl.utils` are entered without running their __init__ (which import torch), and the
    rollout-tracing decorator, the one thing base_tool needs from them, is replaced by a
    pass-through. BaseTool, ToolResponse and the schema models stay verl's own."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed (make venv installs it without dependencies)")
    root = Path(spec.submodule_search_locations[0])
    for name, path in (("verl", root), ("verl.utils", root / "utils")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        monkeypatch.setitem(sys.modules, name, pkg)
    trace = types.ModuleType("verl.utils.rollout_trace")
    trace.rollout_trace_op = lambda fn: fn  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "verl.utils.rollout_trace", trace)
    for name in ("verl.tools", "verl.tools.base_tool", "verl.tools.schemas"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_verl_tool_is_a_base_tool_keeping_files_per_request(
    http_deployment: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TangramCodeTool subclasses verl's BaseTool; driven as verl's tool agent loop drives it
    (create / execute / release around every call), files persist per request_id and not
    across rollouts."""
    _verl_tools_without_ray(monkeypatch)
    from tangram_celery.integrations import verl as adapter

    monkeypatch.setattr(adapter, "_TOOL", None)
    from verl.tools.base_tool import BaseTool

    tool = adapter.TangramCodeTool({"tangram_url": http_deployment.http_url}, None)
    assert isinstance(tool, BaseTool) and tool.name == "code_interpreter"

    class AgentData:
        def __init__(self, request_id: str) -> None:
            self.request_id = request_id

    async def call(request_id: str, code: str) -> str:
        instance_id, _ = await tool.create(create_kwargs={})
        try:
            response, reward, metrics = await tool.execute(
                instance_id, {"code": code}, agent_data=AgentData(request_id)
            )
        finally:
            await tool.release(instance_id)
        assert reward == 0.0 and metrics["tangram_status"] in ("ok", "failed")
        return str(response.text)

    async def rollout() -> tuple[str, str]:
        await call("r-1", "open('notes.txt', 'w').write('step one')")
        same = await call("r-1", "print(open('notes.txt').read())")
        other = await call("r-2", "import os; print(os.path.exists('notes.txt'))")
        return same, other

    same, other = asyncio.run(rollout())
    assert "step one" in same
    assert "False" in other


def test_a_restarted_http_server_keeps_its_url(http_deployment: Any) -> None:
    """Given `tangram serve` on a port picked at start (`http.port: 0`), when it is SIGKILLed
    (the supervisor restarts it), then it serves again on the same URL: a SandboxFusion client
    configured with the printed URL keeps working."""
    url = http_deployment.http_url
    assert requests.get(url + "/v1/ping", timeout=10).ok
    old = http_deployment.kill("http")
    deadline = time.monotonic() + 60
    while True:
        child = http_deployment.children["http"]
        try:
            if child.proc.pid != old and requests.get(url + "/v1/ping", timeout=5).ok:
                break
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, f"nothing serves {url} after the restart"
        time.sleep(0.2)
    body = {"code": "print(6 * 7)", "language": "python", "run_timeout": 10}
    res = requests.post(url + "/run_code", json=body, timeout=60).json()
    assert res["status"] == "Success" and res["run_result"]["stdout"] == "42\n", res


def test_a_restarted_stack_keeps_its_http_url(tmp_path: Path) -> None:
    """Given `tangram up` with `http.port: 0`, when it is stopped and started again over the same
    state directory, then the HTTP server comes back on the same URL (a verl config naming it
    stays right) and serves. When another process has taken that port, the third start still
    comes up, on another port."""
    import socket

    import tangram_celery.deploy as deploy
    from tangram_celery.common.config import load_config
    from tests.fixtures.redis import deployment_config

    path = deployment_config(tmp_path, nodes={"cpu": []})
    urls = []
    squatter = socket.socket()
    try:
        for run in range(3):
            if run == 2:  # another process holds the kept port now
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                squatter.bind(("127.0.0.1", int(urls[0].rsplit(":", 1)[1])))
                squatter.listen(1)
            dep = deploy.Deployment(load_config(path), path, with_flower=False, with_http=True)
            try:
                dep.start(progress=False)
                urls.append(dep.http_url)
                assert requests.get(dep.http_url + "/v1/ping", timeout=10).ok
            finally:
                dep.stop()
    finally:
        squatter.close()
    assert urls[0] == urls[1] != urls[2], urls
