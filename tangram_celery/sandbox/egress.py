"""Outbound network for sandboxes (`sandbox.network: true`): each sandbox its own network
namespace, routed through a filtering router namespace per worker; never the host's network.

    sandbox netns (eth0, 100.80.x.y/31) --veth-- router netns `tge-<scope>-<incarnation>`
        (tgs<n> per sandbox; iptables filter, egress_rules; MASQUERADE) --veth up0/tgu<tag>--
    uplink (the worker's netns, or sandbox.egress_uplink): forwards and masquerades to its
    default route, and delivers nothing from the router to itself but DNS to a local resolver.

One /31 link per sandbox and no bridge: every packet of a sandbox is routed, so the router's
filter sees it, and no sandbox reaches another at layer 2. IPv6 is disabled in the sandbox's
namespace before its link comes up (no link-local address either), and the router drops IPv6.
The sandbox's user has no CAP_NET_ADMIN or CAP_NET_RAW: it cannot change its address or routes,
open raw sockets or re-enable IPv6, and the filter works on addresses, so a DNS answer that
points at a private address (rebinding) leads nowhere either.

Cleanup: `release` deletes a sandbox's link (the kernel deletes it anyway with the namespace);
`close` deletes the router (its uplink link goes with it) and this worker's uplink rules. A
worker killed outright leaves them; the next worker of the same scope removes them before it
serves (`sweep`), as it does its previous incarnation's cgroups and containers.
"""

from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import urlsplit

import tangram_celery.sandbox.egress_rules as rules
from tangram_celery.common.config import SandboxConfig, TangramConfig, expand_env
from tangram_celery.common.errors import ConfigError, SandboxError
from tangram_celery.sandbox.stage import SandboxScope

log = logging.getLogger(__name__)
NETNS_DIR = Path("/run/netns")
LOCK_PATH = "/run/tangram-egress.lock"  # uplink links are numbered under it, host-wide
PREFIX = "tge-"
TOOLS = ("ip", "iptables-restore", "ip6tables-restore", "iptables", "nsenter")
CMD_TIMEOUT_S = 30.0
_NO_V6 = "for f in all default eth0; do echo 1 > /proc/sys/net/ipv6/conf/$f/disable_ipv6 2>/dev/null; done; "


def _run(argv: list[str], stdin: str | None = None, check: bool = True) -> str:
    try:
        p = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxError(f"sandbox network: {argv[0]} failed: {e}") from None
    if check and p.returncode != 0:
        raise SandboxError(f"sandbox network: `{' '.join(argv[:6])}` failed: {p.stderr.strip()[-500:]}")
    return p.stdout


def _enter(path: str | None) -> list[str]:
    """Prefix that runs a command in the network namespace at `path` (None: this process's)."""
    return [] if path is None else ["nsenter", f"--net={path}", "--"]


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def host_resolvers(path: str = "/etc/resolv.conf") -> list[str]:
    """The host's IPv4 nameservers a sandbox can reach (loopback ones are the host's own)."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                addr = ipaddress.ip_address(parts[1])
            except ValueError:
                continue
            if addr.version == 4 and not addr.is_loopback:
                out.append(str(addr))
    return out[:3]


def endpoint_addrs(hosts: Iterable[str]) -> list[str]:
    """IPv4 addresses of the deployment's endpoints (broker, HTTP, ...), for the deny list."""
    out: list[str] = []
    for host in hosts:
        if not host or host in ("0.0.0.0", "::", "embedded"):
            continue
        try:
            infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
        except OSError as e:
            log.warning("sandbox network: cannot resolve the deployment's host %r to deny it: %s", host, e)
            continue
        out += [str(i[4][0]) for i in infos]
    return list(dict.fromkeys(out))


def deployment_hosts(cfg: TangramConfig) -> tuple[str, ...]:
    """Addresses of the deployment's endpoints no sandbox may reach even inside
    `sandbox.egress_allow` (the broker, the HTTP server, Flower): the worker passes them to
    `open_sandbox`. Those on the host itself are blocked anyway (the uplink's addresses)."""
    if not cfg.sandbox.network:
        return ()
    hosts = [cfg.http.address, cfg.flower.address]
    if cfg.broker.url.startswith(("redis://", "rediss://")):
        try:
            hosts.append(urlsplit(expand_env(cfg.broker.url, "broker.url")).hostname or "")
        except (ConfigError, ValueError) as e:
            log.warning("sandbox network: cannot read the broker's host to deny it: %s", e)
    return tuple(endpoint_addrs(hosts))


def _local_addrs(ns_path: str | None) -> list[str]:
    data = json.loads(_run([*_enter(ns_path), "ip", "-j", "-4", "addr", "show"]) or "[]")
    return [a["local"] for link in data for a in link.get("addr_info", []) if "local" in a]


class Egress:
    """One worker's router namespace and its sandboxes' links; see the module docstring."""

    def __init__(
        self, cfg: SandboxConfig, who: SandboxScope, stage_dir: Path, deny: Iterable[str] = ()
    ) -> None:
        if missing_tools():
            raise SandboxError(
                f"sandbox.network needs {', '.join(missing_tools())}: apt-get install iproute2 iptables util-linux"
            )
        self.scope, self.incarnation = who.scope, who.incarnation
        self.tag = hashlib.sha256(f"{who.scope}-{who.incarnation}".encode()).hexdigest()[:8]
        self.router = f"{PREFIX}{who.scope}-{who.incarnation}"
        self.router_path = str(NETNS_DIR / self.router)
        self.uplink_path = str(NETNS_DIR / cfg.egress_uplink) if cfg.egress_uplink else None
        if self.uplink_path is not None and not os.path.exists(self.uplink_path):
            raise SandboxError(
                f"sandbox.egress_uplink: no network namespace {cfg.egress_uplink!r} (ip netns list)"
            )
        self.dev = f"tgu{self.tag}"
        self.resolvers = list(cfg.dns) if cfg.dns is not None else host_resolvers()
        if not self.resolvers:
            log.warning(
                "sandbox network: no resolver (sandbox.dns, or a non-loopback one in /etc/resolv.conf)"
            )
        self.resolv_conf = stage_dir / "resolv.conf"
        self._lock = threading.Lock()
        self._links: dict[str, tuple[int, str | None]] = {}  # key -> (link index, our named netns)
        self._uplink_rules = False
        try:
            self._setup(cfg, list(deny))
        except BaseException:
            self.close()
            raise

    def _setup(self, cfg: SandboxConfig, deny: list[str]) -> None:
        up = _enter(self.uplink_path)
        with open(LOCK_PATH, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            local = _local_addrs(self.uplink_path)
            used = {a for a in local if ipaddress.ip_address(a) in rules.UPLINK_NET}
            index = next(i for i in range(1 << 15) if rules.link_addrs(rules.UPLINK_NET, i)[0] not in used)
            host_end, router_end = rules.link_addrs(rules.UPLINK_NET, index)
            _run(["ip", "netns", "add", self.router])
            _run(
                [
                    *up,
                    "ip",
                    "link",
                    "add",
                    self.dev,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    rules.UPLINK_IF,
                    "netns",
                    self.router,
                ]
            )
            _run([*up, "ip", "addr", "add", f"{host_end}/31", "dev", self.dev])
            _run([*up, "ip", "link", "set", self.dev, "up"])
        batch = (
            f"link set lo up\naddr add {router_end}/31 dev {rules.UPLINK_IF}\nlink set {rules.UPLINK_IF} up\n"
        )
        batch += f"route add default via {host_end} dev {rules.UPLINK_IF}\n"
        sysctl = "echo 1 > /proc/sys/net/ipv4/ip_forward; for f in all default; do "
        sysctl += "echo 1 > /proc/sys/net/ipv4/conf/$f/rp_filter; done; " + _NO_V6.replace(" eth0", "")
        _run([*_enter(self.router_path), "sh", "-c", sysctl + "exec ip -batch -"], stdin=batch)
        policy = rules.Policy(tuple(self.resolvers), tuple(cfg.egress_allow), tuple([*deny, *local]))
        _run([*_enter(self.router_path), "iptables-restore"], stdin=rules.router_rules(policy))
        _run([*_enter(self.router_path), "ip6tables-restore"], stdin=rules.ROUTER_RULES6)
        # the uplink forwards: on the host's own namespace a global switch, as Docker's bridge needs
        _run([*up, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
        label = f"{self.scope} {self.incarnation}"
        self._uplink_rules = True
        for text in rules.uplink_rules(self.tag, self.dev, router_end, self.resolvers, label).values():
            _run([*up, "iptables-restore", "--noflush"], stdin=text)
        body = "".join(f"nameserver {r}\n" for r in self.resolvers) + "options timeout:2 attempts:2\n"
        tmp = self.resolv_conf.with_suffix(".tmp")
        tmp.write_text(body)
        os.chmod(tmp, 0o644)
        tmp.rename(self.resolv_conf)
        log.info(
            "sandbox network: router %s, uplink %s via %s", self.router, self.uplink_path or "host", host_end
        )

    # -- sandboxes -------------------------------------------------------------------------------
    def new_netns(self, key: str) -> str:
        """A fresh named network namespace for a sandbox, linked to the router; its path."""
        name = f"{self.router}-{key}"
        _run(["ip", "netns", "add", name])
        path = str(NETNS_DIR / name)
        try:
            self.attach(key, name, path, named=name)
        except BaseException:
            _run(["ip", "netns", "del", name], check=False)
            raise
        return path

    def attach(self, key: str, target: str, path: str, named: str | None = None) -> None:
        """Link the sandbox network namespace `target` (a name or a pid, as `ip` takes it; at
        `path`) to the router: its own /31, a default route, no IPv6."""
        self.release(key)
        with self._lock:
            taken = {i for i, _ in self._links.values()}
            index = next(i for i in range(1 << 15) if i not in taken)
            self._links[key] = (index, named)
        router_end, sandbox_end = rules.link_addrs(rules.SANDBOX_NET, index)
        ifname = f"{rules.SANDBOX_IF}{index}"
        try:
            _run(
                ["ip", "-n", self.router, "-batch", "-"],
                stdin=(
                    f"link add {ifname} type veth peer name eth0 netns {target}\n"
                    f"addr add {router_end}/31 dev {ifname}\nlink set {ifname} up\n"
                ),
            )
            batch = f"link set lo up\naddr add {sandbox_end}/31 dev eth0\nlink set eth0 up\n"
            batch += f"route add default via {router_end} dev eth0\n"
            _run([*_enter(path), "sh", "-c", _NO_V6 + "exec ip -batch -"], stdin=batch)
        except BaseException:
            self.release(key)
            raise

    def release(self, key: str) -> None:
        """Remove a sandbox's link (and the namespace `new_netns` made); never raises."""
        with self._lock:
            entry = self._links.pop(key, None)
        if entry is None:
            return
        index, named = entry
        _quiet(["ip", "-n", self.router, "link", "del", f"{rules.SANDBOX_IF}{index}"])
        if named is not None:
            _quiet(["ip", "netns", "del", named])

    def close(self) -> None:
        for key in list(self._links):
            self.release(key)
        _quiet(["ip", "netns", "del", self.router])  # its end of the uplink link goes with it
        if self._uplink_rules:
            sweep_rules(self.uplink_path, self.scope, lambda inc: inc == self.incarnation)
            self._uplink_rules = False
        self.resolv_conf.unlink(missing_ok=True)


def _quiet(argv: list[str]) -> None:
    try:
        _run(argv, check=False)
    except SandboxError as e:
        log.debug("%s", e)


def sweep_rules(uplink_path: str | None, scope: str, dead: Callable[[str], bool]) -> int:
    """Remove the uplink rules of `scope`'s incarnations that `dead` names; how many jumps."""
    n = 0
    for table in ("filter", "nat"):
        try:
            saved = _run([*_enter(uplink_path), "iptables", "-t", table, "-S"])
        except SandboxError as e:
            log.debug("%s", e)
            continue
        for argv in rules.sweep_commands(saved, table, scope, dead):
            n += argv[2] == "-D"
            _quiet([*_enter(uplink_path), "iptables", *argv])
    return n


def sweep(scope: str, uplink: str | None, alive: Callable[[str], bool]) -> int:
    """Remove routers, sandbox namespaces and uplink rules (in the named namespace `uplink`, or
    this process's) that incarnations of `scope` for which `alive` is false left (a worker
    killed outright); never another scope's. Runs whatever sandbox.network says now: the
    worker that left them may have had it on. Returns how many things it removed."""
    if shutil.which("ip") is None or not NETNS_DIR.is_dir():
        return 0
    head = f"{PREFIX}{scope}-"
    names = sorted((p.name for p in NETNS_DIR.iterdir() if p.name.startswith(head)), key=len, reverse=True)
    gone = [n for n in names if not alive(n[len(head) :].split("-", 1)[0])]
    for name in gone:  # sandboxes' namespaces first (longer names), then the routers
        _quiet(["ip", "netns", "del", name])
    path = str(NETNS_DIR / uplink) if uplink else None
    n = 0
    if shutil.which("iptables") and (path is None or os.path.exists(path)):
        n = sweep_rules(path, scope, lambda inc: not alive(inc))
    if gone or n:
        log.warning("sandbox network: removed %d namespace(s), %d rule(s) of a gone worker", len(gone), n)
    return len(gone) + n
