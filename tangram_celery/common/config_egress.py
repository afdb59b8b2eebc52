"""Types of the sandbox egress settings (`sandbox.egress_allow`, `sandbox.dns`,
`sandbox.egress_uplink`; docs/sandbox.md, Network): validated here so that a typo fails at load,
with the fix, and not as a rule `iptables` refuses on a worker."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

from pydantic import AfterValidator, Field

# never reachable from a sandbox, whatever the allowlist says (docs/sandbox.md, Network)
NEVER_ALLOWED = tuple(
    ipaddress.ip_network(n)
    for n in ("0.0.0.0/8", "127.0.0.0/8", "224.0.0.0/3", "::/128", "::1/128", "ff00::/8")
)


def _cidrs(v: list[str]) -> list[str]:
    out = []
    for s in v:
        try:
            net = ipaddress.ip_network(s, strict=True)
        except ValueError as e:
            raise ValueError(
                f"{s!r} is not a network in CIDR form ({e}); write e.g. '10.1.0.0/16' (host bits zero) "
                "or '192.0.2.7/32' for one address"
            ) from None
        if net.prefixlen == 0:
            raise ValueError(f"{s!r} allows every address: list only the private ranges sandboxes may reach")
        bad = next((n for n in NEVER_ALLOWED if n.version == net.version and net.overlaps(n)), None)
        if bad is not None:
            raise ValueError(f"{s!r} overlaps {bad}, which sandboxes may never reach (loopback/multicast)")
        out.append(str(net))
    return out


def _resolvers(v: list[str] | None) -> list[str] | None:
    if v is None:
        return None
    out = []
    for s in v:
        try:
            addr = ipaddress.ip_address(s)
        except ValueError:
            raise ValueError(f"{s!r} is not an IP address: sandbox.dns lists resolvers by address") from None
        if addr.version != 4 or addr.is_loopback or addr.is_unspecified or addr.is_multicast:
            raise ValueError(
                f"resolver {s!r} cannot serve sandboxes: give an IPv4 address outside loopback (a "
                "sandbox's 127.0.0.1 is its own; e.g. the host's LAN address or an upstream resolver)"
            )
        out.append(str(addr))
    if len(out) > 3:
        raise ValueError("sandbox.dns takes at most 3 resolvers (resolv.conf reads no more)")
    return out


def _netns(v: str | None) -> str | None:
    if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", v):
        raise ValueError(f"{v!r} is not a network namespace name (as `ip netns list` shows them)")
    return v


EgressAllow = Annotated[
    list[str],
    AfterValidator(_cidrs),
    Field(
        description="with network on: private or link-local ranges (CIDRs) sandboxes may reach after "
        "all; the host's own addresses, the deployment's endpoints and loopback stay blocked",
    ),
]
Resolvers = Annotated[
    list[str] | None,
    AfterValidator(_resolvers),
    Field(
        description="with network on: the IPv4 resolvers written to the sandboxes' /etc/resolv.conf, "
        "the only DNS servers they can reach (default: the host's non-loopback nameservers)",
    ),
]
Uplink = Annotated[
    str | None,
    AfterValidator(_netns),
    Field(
        description="with network on: the named network namespace (`ip netns`) sandbox traffic leaves "
        "through, NATed to its default route (default: the worker's own)",
    ),
]
