"""The egress filter as data: which destinations a sandbox may reach, as `iptables-restore` text
for the worker's router namespace and for the uplink (the host). Pure: no I/O, unit-tested.

Order of the router's FORWARD rules for a packet from a sandbox (`tgs+` interfaces):
1. replies of allowed connections pass (conntrack);
2. anything not bound for the uplink is rejected (no sandbox reaches another sandbox);
3. DNS (udp/tcp 53) passes to the configured resolvers only;
4. the deployment's endpoints, the uplink's (host's) own addresses and `ALWAYS_BLOCKED` are
   rejected, whatever the allowlist says;
5. `egress_allow` passes; then the private ranges (`PRIVATE`) are rejected;
6. the rest passes, masqueraded to the uplink's address.
Rejections answer at once (TCP reset, ICMP admin-prohibited), so hostile code learns nothing a
timeout would not tell it and honest code fails fast. IPv6 is off in sandboxes; the router
drops every IPv6 packet besides.
"""

from __future__ import annotations

import ipaddress
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass

Net = ipaddress.IPv4Network
# router <-> sandbox links (/31 each; inside a router namespace only) and uplink links (/31 per
# worker on a host); both in the shared address space, which sandboxes cannot reach
SANDBOX_NET = ipaddress.ip_network("100.80.0.0/16")
UPLINK_NET = ipaddress.ip_network("100.81.0.0/16")
ALWAYS_BLOCKED = tuple(
    ipaddress.ip_network(n)
    for n in ("0.0.0.0/8", "127.0.0.0/8", "224.0.0.0/3", str(SANDBOX_NET), str(UPLINK_NET))
)
# private, shared, link-local (cloud metadata: 169.254.169.254) and benchmark ranges
PRIVATE = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "169.254.0.0/16",
        "100.64.0.0/10",
        "198.18.0.0/15",
    )
)
SANDBOX_IF = "tgs"  # router-side ends of sandbox links: tgs<n>
UPLINK_IF = "up0"  # the router's end of its uplink
REJECT = "TG-REJECT"
COMMENT = "tangram-egress"


@dataclass(frozen=True)
class Policy:
    """What one worker's sandboxes may reach (IPv4 only)."""

    resolvers: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()  # sandbox.egress_allow (IPv4 entries are used)
    deny: tuple[str, ...] = ()  # the deployment's endpoints and the uplink's own addresses

    def denied(self) -> list[str]:
        """Always-rejected destinations, deduplicated, as CIDRs."""
        nets = [*(str(_v4(d)) for d in self.deny if _v4(d) is not None), *map(str, ALWAYS_BLOCKED)]
        return list(dict.fromkeys(nets))


def _v4(s: str) -> Net | None:
    net = ipaddress.ip_network(s, strict=False)
    return net if isinstance(net, ipaddress.IPv4Network) else None


def router_rules(p: Policy) -> str:
    """`iptables-restore` input for a fresh router namespace (filter and nat tables)."""
    sb = f"-i {SANDBOX_IF}+"
    out = [
        "*filter",
        ":INPUT DROP [0:0]",
        ":FORWARD DROP [0:0]",
        ":OUTPUT ACCEPT [0:0]",
        f":{REJECT} - [0:0]",
    ]
    out += [f"-A {REJECT} -p tcp -j REJECT --reject-with tcp-reset"]
    out += [f"-A {REJECT} -j REJECT --reject-with icmp-admin-prohibited"]
    # the router itself serves nothing: replies to its own traffic only
    out += ["-A INPUT -i lo -j ACCEPT", "-A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"]
    out += [f"-A INPUT {sb} -j {REJECT}"]
    out += ["-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"]
    out += [f"-A FORWARD {sb} ! -o {UPLINK_IF} -j {REJECT}"]
    for r in p.resolvers:
        for proto in ("udp", "tcp"):
            out.append(f"-A FORWARD {sb} -d {r}/32 -p {proto} --dport 53 -j ACCEPT")
    for proto in ("udp", "tcp"):
        out.append(f"-A FORWARD {sb} -p {proto} --dport 53 -j {REJECT}")
    out += [f"-A FORWARD {sb} -d {d} -j {REJECT}" for d in p.denied()]
    out += [f"-A FORWARD {sb} -d {a} -j ACCEPT" for a in p.allow if _v4(a) is not None]
    out += [f"-A FORWARD {sb} -d {n} -j {REJECT}" for n in PRIVATE]
    out += [f"-A FORWARD {sb} -o {UPLINK_IF} -j ACCEPT", "COMMIT"]
    out += ["*nat", ":PREROUTING ACCEPT [0:0]", ":INPUT ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]"]
    out += [":POSTROUTING ACCEPT [0:0]", f"-A POSTROUTING -o {UPLINK_IF} -j MASQUERADE", "COMMIT"]
    return "\n".join(out) + "\n"


ROUTER_RULES6 = "*filter\n:INPUT DROP [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT DROP [0:0]\nCOMMIT\n"


def chain_name(tag: str) -> str:
    """The uplink's chain for the worker tagged `tag` (8 hex digits): `TGE-<tag>` (<= 28 chars)."""
    return f"TGE-{tag}"


def uplink_rules(
    tag: str, dev: str, router_addr: str, resolvers: Iterable[str], label: str
) -> dict[str, str]:
    """`iptables-restore --noflush` input per table for the uplink (host) side of one worker's
    router: its traffic is forwarded and masqueraded, never delivered to the host itself
    (except DNS to a resolver the host runs). `label` (scope and incarnation) marks the jumps
    for the sweep of a dead worker's rules."""
    c, cin = chain_name(tag), chain_name(tag) + "-in"
    mark = f'-m comment --comment "{COMMENT} {label}"'
    filt = ["*filter", f":{c} - [0:0]", f":{cin} - [0:0]"]
    filt += [f"-A {cin} -d {r}/32 -p {p} --dport 53 -j ACCEPT" for r in resolvers for p in ("udp", "tcp")]
    filt += [f"-A {cin} -j DROP"]  # nothing of the host's own, on any of its addresses
    filt += [f"-A {c} -i {dev} -j ACCEPT"]  # forwarded out (the router filtered it)
    filt += [f"-A {c} -o {dev} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"]
    filt += [f"-A {c} -o {dev} -j DROP"]
    filt += [f"-I INPUT 1 -i {dev} {mark} -j {cin}", f"-I FORWARD 1 -i {dev} {mark} -j {c}"]
    filt += [f"-I FORWARD 1 -o {dev} {mark} -j {c}", "COMMIT"]
    nat = ["*nat", f":{c} - [0:0]", f"-A {c} ! -o {dev} -j MASQUERADE"]
    nat += [f"-I POSTROUTING 1 -s {router_addr}/32 {mark} -j {c}", "COMMIT"]
    return {"filter": "\n".join(filt) + "\n", "nat": "\n".join(nat) + "\n"}


def link_addrs(net: ipaddress.IPv4Network | ipaddress.IPv6Network, index: int) -> tuple[str, str]:
    """(router-side, far-side) addresses of the `index`-th /31 link of `net`."""
    base = int(net.network_address) + 2 * index
    if base + 1 > int(net.broadcast_address):
        raise ValueError(f"no link {index} in {net}")
    return str(ipaddress.ip_address(base)), str(ipaddress.ip_address(base + 1))


def sweep_commands(saved: str, table: str, scope: str, dead: Callable[[str], bool]) -> list[list[str]]:
    """`iptables` argv lists that remove the jumps (marked `COMMENT <scope> <incarnation>`) of
    dead incarnations from `iptables -t table -S` output, then flush and delete their chains."""
    key = f'--comment "{COMMENT} {scope} '
    cmds: list[list[str]] = []
    chains: list[str] = []
    for line in saved.splitlines():
        if not line.startswith("-A ") or key not in line:
            continue
        if not dead(line.split(key, 1)[1].split('"', 1)[0]):
            continue
        args = shlex.split(line)
        cmds.append(["-t", table, "-D", *args[1:]])
        if "-j" in args:
            chains.append(args[args.index("-j") + 1])
    for c in dict.fromkeys(chains):
        cmds += [["-t", table, "-F", c], ["-t", table, "-X", c]]
    return cmds
