"""Sandbox egress (`sandbox.network: true`, issue 37), proven from inside a sandbox.

The test builds its own little internet out of network namespaces and routes the sandboxes'
egress into it; no packet ever goes to an address outside namespaces it made:

    sandbox --(router, product)-- uplink `<p>-up` 198.51.100.2 --- `<p>-net` 198.51.100.1
                                   "redis" on :6379              203.0.113.1 (public), 203.0.113.53
                                   127.0.0.1:6380                (resolver), 10.9.0.1 + 10.9.0.2
                                                                 (private, allowlisted; .2 is a
                                                                 deployment endpoint), 192.168.77.1,
                                                                 172.16.5.1, 169.254.169.254,
                                                                 100.64.1.1: a TCP server on :8080
`sandbox.egress_uplink` names the uplink namespace, so the host's own network is not touched.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox import ExecRequest
from tests.fixtures.common import unavailable
from tests.fixtures.docker import SMALL_LIMITS, backend_config
from tests.fixtures.netns import namespaces_up

SERVERS = Path(__file__).with_name("egress_servers.py")
PUBLIC, RESOLVER, ALLOWED, ENDPOINT = "203.0.113.1", "203.0.113.53", "10.9.0.1", "10.9.0.2"
BLOCKED = ("192.168.77.1", "172.16.5.1", "169.254.169.254", "100.64.1.1")
UPLINK_ADDR = "198.51.100.2"
NET_ADDRS = (PUBLIC, RESOLVER, ALLOWED, ENDPOINT, *BLOCKED)

PROBE = r"""
import json, socket, subprocess
def tcp(host, port):
    try:
        with socket.create_connection((host, port), timeout=3) as s:
            return "ok " + s.recv(100).decode().strip()
    except Exception as e:
        return type(e).__name__
def udp_dns(host):
    q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x04test\x00\x00\x01\x00\x01"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(2); s.connect((host, 53)); s.send(q)
            return "answer %d bytes" % len(s.recv(512))
    except Exception as e:
        return type(e).__name__
def attempt(fn):
    try:
        fn(); return "ok"
    except Exception as e:
        return type(e).__name__
out = {t: tcp(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for t in TARGETS}
try:
    out["name"] = socket.gethostbyname("example.test")
except Exception as e:
    out["name"] = type(e).__name__
out["resolv"] = open("/etc/resolv.conf").read()
out["dns_elsewhere"] = udp_dns(PUBLIC)
out["raw"] = attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
out["v6"] = attempt(lambda: socket.create_connection(("2001:db8::1", 8080), timeout=2))
out["v6_addrs"] = open("/proc/net/if_inet6").read()
r = subprocess.run(["ip", "route", "replace", "default", "via", "100.80.0.0"], capture_output=True)
out["route_change"] = r.returncode
print(json.dumps(out))
"""


def tid() -> str:
    return "t-" + uuid.uuid4().hex[:10]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Internet:
    """The test's namespaces (see the module docstring), deleted by name at the end."""

    def __init__(self) -> None:
        self.prefix = f"tgx{secrets.token_hex(3)}"
        self.up, self.net = f"{self.prefix}-up", f"{self.prefix}-net"
        self.made: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    def create(self) -> None:
        for ns in (self.up, self.net):
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        a, b = f"{self.prefix}a", f"{self.prefix}b"
        _ip("-n", self.up, "link", "add", a, "type", "veth", "peer", "name", b, "netns", self.net)
        _ip("-n", self.up, "addr", "add", f"{UPLINK_ADDR}/24", "dev", a)
        _ip("-n", self.up, "link", "set", a, "up")
        _ip("-n", self.up, "route", "add", "default", "via", "198.51.100.1")
        _ip("-n", self.net, "addr", "add", "198.51.100.1/24", "dev", b)
        _ip("-n", self.net, "link", "set", b, "up")
        for addr in NET_ADDRS:
            _ip("-n", self.net, "addr", "add", f"{addr}/32", "dev", "lo")
        self._serve(self.net, "tcp", "0.0.0.0", "8080")
        # UDP answers come from the address bound (0.0.0.0 would answer from 198.51.100.1)
        self._serve(self.net, "dns", RESOLVER, "53", "203.0.113.7")
        self._serve(self.net, "dns", PUBLIC, "53", "203.0.113.7")  # a resolver not configured
        self._serve(self.up, "tcp", "0.0.0.0", "6379")  # the deployment's "redis" on the uplink
        self._serve(self.up, "tcp", "127.0.0.1", "6380")  # and something on its loopback

    def _serve(self, ns: str, *args: str) -> None:
        argv = ["ip", "netns", "exec", ns, sys.executable, str(SERVERS), *args]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready", (
            "a test server did not start"
        )

    def delete(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=10)
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def internet() -> Iterator[Internet]:
    from tangram_celery.sandbox.egress import missing_tools

    if os.geteuid() != 0 or missing_tools():
        unavailable(f"sandbox egress needs root and {', '.join(missing_tools()) or 'ip, iptables, nsenter'}")
    with namespaces_up(Internet()) as net:
        yield net


@pytest.fixture(scope="module", params=["namespace-builtin", "namespace-bwrap", "docker"])
def egress_box(request: pytest.FixtureRequest, internet: Internet) -> Iterator[Any]:
    """A sandbox pool with network on, egress through the test's uplink namespace."""
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.common.errors import SandboxError
    from tangram_celery.sandbox import open_sandbox

    base = backend_config(request)
    cfg = SandboxConfig.model_validate(
        {
            **base,
            **SMALL_LIMITS,
            "prewarm": 0,
            "network": True,
            "egress_uplink": internet.up,
            "egress_allow": ["10.9.0.0/24"],
            "dns": [RESOLVER],
        }
    )
    try:
        box = open_sandbox(cfg, egress_deny=(ENDPOINT,))
    except SandboxError as e:
        unavailable(f"{request.param} sandbox backend with network unavailable: {e}")
    try:
        yield box
    finally:
        box.close()


def probe(box: Any, targets: list[str]) -> dict[str, Any]:
    code = f"TARGETS = {targets!r}\nPUBLIC = {PUBLIC!r}\n" + PROBE
    res = box.run(tid(), ExecRequest(language="python", code=code, timeout_s=60))
    assert res.status is ActionStatus.OK, res
    return dict(json.loads(res.stdout))


def test_sandbox_reaches_the_internet_and_allowlisted_ranges_only(egress_box: Any) -> None:
    """Given network on with 10.9.0.0/24 allowlisted, when sandbox code connects out, then the
    public address and the allowlisted one answer, and every private, link-local and shared
    address, the deployment's endpoint inside the allowlist and the uplink host are refused."""
    targets = [f"{a}:8080" for a in (PUBLIC, ALLOWED, ENDPOINT, *BLOCKED)]
    targets += [f"{UPLINK_ADDR}:6379", "100.81.0.0:6379", "100.80.0.0:53", "127.0.0.1:6380"]
    out = probe(egress_box, targets)
    assert out[f"{PUBLIC}:8080"] == f"ok hello {PUBLIC}:8080", out
    assert out[f"{ALLOWED}:8080"] == f"ok hello {ALLOWED}:8080", out
    for t in targets[2:]:
        assert out[t] in ("ConnectionRefusedError", "TimeoutError", "OSError"), (t, out)


def test_dns_goes_only_through_the_configured_resolver(egress_box: Any) -> None:
    """Given sandbox.dns, then /etc/resolv.conf names it, a name resolves through it, and a
    query to any other server gets no answer."""
    out = probe(egress_box, [])
    assert f"nameserver {RESOLVER}" in out["resolv"], out
    assert out["name"] == "203.0.113.7", out
    assert not out["dns_elsewhere"].startswith("answer"), out


def test_hostile_code_cannot_widen_its_network(egress_box: Any) -> None:
    """Given hostile sandbox code, then it opens no raw socket, has no IPv6 at all (not even
    link-local), and cannot change its routes."""
    out = probe(egress_box, [])
    assert out["raw"] == "PermissionError", out
    assert out["v6"] != "ok" and out["v6_addrs"] == "", out
    assert out["route_change"] != 0, out


def test_no_network_stays_loopback_only(internet: Internet) -> None:
    """Given the default network: false, then a sandbox has loopback only (no route out)."""
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.common.errors import SandboxError
    from tangram_celery.sandbox import open_sandbox

    cfg = SandboxConfig.model_validate({"backend": "namespace", **SMALL_LIMITS, "prewarm": 0})
    try:
        box = open_sandbox(cfg)
    except SandboxError as e:
        unavailable(f"namespace backend unavailable: {e}")
    try:
        code = "print(open('/proc/net/dev').read())"
        res = box.run(tid(), ExecRequest(language="python", code=code, timeout_s=30))
        assert res.status is ActionStatus.OK, res
        lines = [ln.split(":")[0].strip() for ln in res.stdout.splitlines()[2:] if ln.strip()]
        assert lines == ["lo"], res.stdout
    finally:
        box.close()


def test_close_removes_router_namespaces_and_uplink_rules(internet: Internet) -> None:
    """Given a pool with network that is closed, then no router or sandbox namespace and no
    uplink rule of its scope is left."""
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.common.errors import SandboxError
    from tangram_celery.sandbox import open_sandbox

    cfg = SandboxConfig.model_validate(
        {**SMALL_LIMITS, "backend": "namespace", "prewarm": 0, "network": True, "egress_uplink": internet.up}
    )
    try:
        box = open_sandbox(cfg)
    except SandboxError as e:
        unavailable(f"namespace backend unavailable: {e}")
    scope, tag = box.who.scope, box.egress.tag
    box.run(tid(), ExecRequest(language="python", code="print(1)", timeout_s=30))
    assert any(n.startswith(f"tge-{scope}") for n in os.listdir("/run/netns"))
    box.close()
    assert not [n for n in os.listdir("/run/netns") if n.startswith(f"tge-{scope}")]
    saved = _saved(internet)
    assert scope not in saved and f"TGE-{tag}" not in saved, saved


def _saved(internet: Internet) -> str:
    argv = ["ip", "netns", "exec", internet.up, "iptables-save"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def test_sweep_removes_what_a_killed_worker_left(internet: Internet, tmp_path: Path) -> None:
    """Given the router, a sandbox namespace and uplink rules of a worker that died without
    closing, when the next worker of the scope sweeps, then all of them are gone."""
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.sandbox.egress import Egress, sweep
    from tangram_celery.sandbox.stage import SandboxScope

    cfg = SandboxConfig.model_validate({"network": True, "egress_uplink": internet.up, "dns": [RESOLVER]})
    who = SandboxScope()
    egress = Egress(cfg, who, tmp_path)  # never closed: its worker "was killed"
    egress.new_netns("s1")
    assert f"TGE-{egress.tag}" in _saved(internet)
    sweep(who.scope, internet.up, lambda inc: inc != who.incarnation)
    assert not [n for n in os.listdir("/run/netns") if n.startswith(f"tge-{who.scope}")]
    assert who.scope not in _saved(internet) and f"TGE-{egress.tag}" not in _saved(internet)


def test_sandboxes_cannot_reach_each_other(egress_box: Any) -> None:
    """Given a sandbox listening on its own address, when another sandbox connects to every
    sandbox address near it, then none answers and the listener accepts nothing."""
    listen = (
        "import socket\ns = socket.socket(); s.bind(('0.0.0.0', 9000)); s.listen(); s.settimeout(8)\n"
        "try:\n    s.accept(); print('accepted')\nexcept TimeoutError:\n    print('none')\n"
    )
    got: list[Any] = []
    t = threading.Thread(
        target=lambda: got.append(
            egress_box.run(tid(), ExecRequest(language="python", code=listen, timeout_s=30))
        )
    )
    t.start()
    time.sleep(2)
    targets = [f"100.80.0.{i}:9000" for i in range(1, 16, 2)]  # sandbox ends of the first links
    out = probe(egress_box, targets)
    t.join(timeout=60)
    assert got and got[0].status is ActionStatus.OK and got[0].stdout.strip() == "none", got
    assert all(not out[x].startswith("ok") for x in targets), out


@pytest.fixture(scope="module", params=["namespace", "docker"])
def image_egress_box(
    request: pytest.FixtureRequest, internet: Internet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """A pool that runs container images, network on, egress through the test's uplink."""
    from tests.fixtures.images import ImageBox, image_pool_config, open_image_pool

    layout = request.getfixturevalue("image_layout")
    cfg = image_pool_config(
        request, layout, tmp_path_factory, network=True, egress_uplink=internet.up, dns=[RESOLVER]
    )
    for pool in open_image_pool(request.param, cfg):
        yield ImageBox(request.param, pool)


def test_image_sandbox_gets_the_same_egress(image_egress_box: Any) -> None:
    """Given a container image's sandbox with network, then its resolv.conf names the
    configured resolver, a public address answers and a private one is refused."""
    script = (
        'cat /etc/resolv.conf; exec 3<>/dev/tcp/203.0.113.1/8080 && read -r line <&3 && echo "$line"; '
        "(exec 4<>/dev/tcp/192.168.77.1/8080) 2>/dev/null && echo private-open || echo private-refused"
    )
    res = image_egress_box.run(tid(), script, timeout_s=30)
    assert res.status is ActionStatus.OK, res
    assert f"nameserver {RESOLVER}" in res.stdout, res.stdout
    assert f"hello {PUBLIC}:8080" in res.stdout and "private-refused" in res.stdout, res.stdout


KILLED_WORKER = """
import sys, time, uuid
from tangram_celery.common.config import SandboxConfig
from tangram_celery.sandbox import ExecRequest, open_sandbox
cfg = SandboxConfig.model_validate({
    "backend": "namespace", "prewarm": 0, "network": True, "egress_uplink": sys.argv[1], "dns": [sys.argv[2]],
})
box = open_sandbox(cfg)
box.run("t-1", ExecRequest(language="python", code="print(1)", timeout_s=30))
print(box.who.scope, box.egress.tag, flush=True)
time.sleep(600)
"""


def test_a_killed_workers_router_is_removed_by_its_reaper(internet: Internet) -> None:
    """Given a worker with network that is SIGKILLed, then its reaper removes its router, its
    sandboxes' namespaces and its uplink rules (no later worker needed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WORKER, internet.up, RESOLVER],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().split()
        assert len(line) == 2, "the worker did not start"
        scope, tag = line
        assert any(n.startswith(f"tge-{scope}") for n in os.listdir("/run/netns"))
    finally:
        proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [n for n in os.listdir("/run/netns") if n.startswith(f"tge-{scope}")]
        if not left and f"TGE-{tag}" not in _saved(internet):
            break
        time.sleep(0.2)
    assert not left, left
    assert scope not in _saved(internet) and f"TGE-{tag}" not in _saved(internet)
