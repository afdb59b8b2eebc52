"""The egress filter as data (`sandbox/egress_rules.py`) and its settings' validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tangram_celery.common.config import SandboxConfig
from tangram_celery.sandbox import egress_rules as rules
from tangram_celery.sandbox.egress import host_resolvers


def _forward(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("-A FORWARD")]


def test_denied_destinations_come_before_the_allowlist_and_private_ranges_after() -> None:
    """Given an allowlisted private range and a deployment endpoint inside it, then the endpoint
    is rejected before the allowlist accepts, and private ranges are rejected after it."""
    p = rules.Policy(resolvers=("192.0.2.53",), allow=("10.9.0.0/24",), deny=("10.9.0.2",))
    fwd = _forward(rules.router_rules(p))
    at = {line: i for i, line in enumerate(fwd)}
    deny = at["-A FORWARD -i tgs+ -d 10.9.0.2/32 -j TG-REJECT"]
    allow = at["-A FORWARD -i tgs+ -d 10.9.0.0/24 -j ACCEPT"]
    private = at["-A FORWARD -i tgs+ -d 10.0.0.0/8 -j TG-REJECT"]
    loopback = at["-A FORWARD -i tgs+ -d 127.0.0.0/8 -j TG-REJECT"]
    assert deny < allow < private and loopback < allow
    assert fwd[-1] == "-A FORWARD -i tgs+ -o up0 -j ACCEPT"
    assert "-A FORWARD -i tgs+ ! -o up0 -j TG-REJECT" in fwd  # no sandbox reaches another


def test_dns_only_to_the_configured_resolver() -> None:
    """Given one resolver, then port 53 is accepted to it and rejected everywhere else."""
    fwd = _forward(rules.router_rules(rules.Policy(resolvers=("192.0.2.53",))))
    ok = fwd.index("-A FORWARD -i tgs+ -d 192.0.2.53/32 -p udp --dport 53 -j ACCEPT")
    assert ok < fwd.index("-A FORWARD -i tgs+ -p udp --dport 53 -j TG-REJECT")


def test_metadata_and_link_local_are_always_rejected_without_an_allow() -> None:
    """Given no allowlist, then 169.254.0.0/16 (cloud metadata) and RFC 1918 are rejected."""
    text = rules.router_rules(rules.Policy())
    for net in ("169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10"):
        assert f"-A FORWARD -i tgs+ -d {net} -j TG-REJECT" in text
    assert ":FORWARD DROP" in text and ":INPUT DROP" in text and "MASQUERADE" in text
    assert ":FORWARD DROP" in rules.ROUTER_RULES6 and ":OUTPUT DROP" in rules.ROUTER_RULES6


def test_uplink_rules_deliver_nothing_to_the_host_but_dns() -> None:
    """Given a host resolver, then the uplink's input chain accepts DNS to it and drops the rest."""
    out = rules.uplink_rules("abcd1234", "tguabcd1234", "100.81.0.1", ["192.0.2.53"], "scope inc")
    filt = out["filter"].splitlines()
    assert filt.index("-A TGE-abcd1234-in -d 192.0.2.53/32 -p udp --dport 53 -j ACCEPT") < filt.index(
        "-A TGE-abcd1234-in -j DROP"
    )
    assert (
        '-I INPUT 1 -i tguabcd1234 -m comment --comment "tangram-egress scope inc" -j TGE-abcd1234-in' in filt
    )
    assert "-A TGE-abcd1234 ! -o tguabcd1234 -j MASQUERADE" in out["nat"]


def test_sweep_removes_only_dead_incarnations_of_the_scope() -> None:
    """Given saved rules of two incarnations and another scope, then only the dead one's jumps
    and chains are removed."""
    saved = "\n".join(
        [
            "-P INPUT ACCEPT",
            '-A INPUT -i tgu1 -m comment --comment "tangram-egress sc dead" -j TGE-1-in',
            '-A INPUT -i tgu2 -m comment --comment "tangram-egress sc live" -j TGE-2-in',
            '-A INPUT -i tgu3 -m comment --comment "tangram-egress other dead" -j TGE-3-in',
        ]
    )
    cmds = rules.sweep_commands(saved, "filter", "sc", lambda inc: inc == "dead")
    assert cmds == [
        [
            "-t",
            "filter",
            "-D",
            "INPUT",
            "-i",
            "tgu1",
            "-m",
            "comment",
            "--comment",
            "tangram-egress sc dead",
            "-j",
            "TGE-1-in",
        ],
        ["-t", "filter", "-F", "TGE-1-in"],
        ["-t", "filter", "-X", "TGE-1-in"],
    ]


def test_link_addresses_are_pairs_of_a_31() -> None:
    """Link n of a /16 is (2n, 2n+1); the last one that fits is refused past it."""
    assert rules.link_addrs(rules.SANDBOX_NET, 0) == ("100.80.0.0", "100.80.0.1")
    assert rules.link_addrs(rules.SANDBOX_NET, 129) == ("100.80.1.2", "100.80.1.3")
    with pytest.raises(ValueError):
        rules.link_addrs(rules.SANDBOX_NET, 1 << 15)


@pytest.mark.parametrize(
    "field,value",
    [
        ("egress_allow", ["10.0.0.1/8"]),  # host bits set: a typo
        ("egress_allow", ["127.0.0.0/16"]),  # loopback can never be allowed
        ("egress_allow", ["0.0.0.0/0"]),
        ("egress_allow", ["not-a-net"]),
        ("dns", ["127.0.0.53"]),  # a sandbox's loopback is its own
        ("dns", ["2001:db8::53"]),  # IPv6 is off in sandboxes
        ("egress_uplink", "bad name"),
    ],
)
def test_bad_egress_settings_fail_at_load(field: str, value: object) -> None:
    """A bad allowlist, resolver or uplink name is refused when the config loads."""
    with pytest.raises(ValidationError):
        SandboxConfig.model_validate({field: value})


def test_good_egress_settings_load() -> None:
    """CIDRs and resolvers load as given; the default is no network and no allowlist."""
    cfg = SandboxConfig.model_validate(
        {"network": True, "egress_allow": ["10.9.0.0/24"], "dns": ["192.0.2.53"]}
    )
    assert cfg.egress_allow == ["10.9.0.0/24"] and cfg.dns == ["192.0.2.53"]
    assert SandboxConfig().network is False and SandboxConfig().egress_allow == []


def test_host_resolvers_skip_loopback_and_ipv6(tmp_path: object) -> None:
    """The default resolvers are the host's IPv4 non-loopback nameservers."""
    from pathlib import Path

    f = Path(str(tmp_path)) / "resolv.conf"
    f.write_text("nameserver 127.0.0.53\nnameserver 192.0.2.1\nnameserver 2001:db8::1\nsearch x\n")
    assert host_resolvers(str(f)) == ["192.0.2.1"]


def test_deployment_hosts_name_the_broker_and_front_doors_only_with_network() -> None:
    """Given a remote broker URL, then its address is denied with network on, nothing without."""
    from tangram_celery.common.config import TangramConfig
    from tangram_celery.sandbox.egress import deployment_hosts

    base = {"broker": {"url": "redis://192.0.2.9:6379/0"}, "http": {"address": "127.0.0.1"}}
    on = TangramConfig.model_validate({**base, "sandbox": {"network": True}})
    assert set(deployment_hosts(on)) == {"192.0.2.9", "127.0.0.1"}
    assert deployment_hosts(TangramConfig.model_validate(base)) == ()
