"""`tangram tenant`'s parsing and printing, without Redis (issue 37): quotas from the flags,
the client URL built from the operator's, secrets shown once and never in `list`."""

from __future__ import annotations

import hashlib
import json

import pytest

from tangram_celery.cli import build_parser
from tangram_celery.common.errors import TangramError
from tangram_celery.common.tenants import Quotas, TenantRecord
from tangram_celery.tenant_cli import (
    Secrets,
    api_shares,
    client_url,
    quotas_of,
    show_list,
    show_secrets,
    token_digest,
)

pytestmark = pytest.mark.unit


def test_add_parses_every_quota() -> None:
    """The flags become the tenant's Quotas."""
    args = build_parser().parse_args(
        [
            "tenant", "add", "acme", "--max-queued", "100", "--max-cores", "8", "--max-memory-mb", "4096",
            "--max-gpu-memory-mb", "2048", "--api-share", "calc=0.5", "--api-share", "llm=1",
            "--priority", "high",
        ]
    )  # fmt: skip
    assert args.tenant_cmd == "add" and args.name == "acme"
    q = quotas_of(args)
    assert q == Quotas(
        max_queued=100,
        max_cores=8,
        max_memory_mb=4096,
        max_gpu_memory_mb=2048,
        api_share={"calc": 0.5, "llm": 1.0},
        priority="high",
    )
    assert quotas_of(build_parser().parse_args(["tenant", "add", "b"])) == Quotas()


def test_bad_quotas_are_refused_with_the_fix() -> None:
    for bad in ("calc", "calc=0", "calc=1.5", "=0.5", "calc=x"):
        with pytest.raises(ValueError, match="API=FRACTION"):
            api_shares([bad])
    with pytest.raises(TangramError, match="bad quotas"):
        quotas_of(build_parser().parse_args(["tenant", "add", "b", "--max-queued", "-1"]))
    with pytest.raises(SystemExit):  # one of the two, not both
        build_parser().parse_args(["tenant", "rotate", "a", "--token-only", "--password-only"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tenant", "add", "a", "--priority", "urgent"])


def test_remove_list_and_rotate_parse() -> None:
    p = build_parser()
    rm = p.parse_args(["tenant", "remove", "acme", "--force"])
    assert (rm.tenant_cmd, rm.name, rm.force) == ("remove", "acme", True)
    ls = p.parse_args(["tenant", "list", "--json"])
    assert ls.tenant_cmd == "list" and ls.json
    rot = p.parse_args(["tenant", "rotate", "acme", "--token-only", "--broker-url", "redis://x"])
    assert rot.token_only and not rot.password_only and rot.broker_url == "redis://x"


def test_the_client_url_is_the_brokers_with_the_tenants_user() -> None:
    """Same scheme, host, port, database and query; the operator's credentials replaced."""
    assert (
        client_url("redis://admin:s3cret@127.0.0.1:6390/0", "tenant-acme", "pw")
        == "redis://tenant-acme:pw@127.0.0.1:6390/0"
    )
    assert (
        client_url("rediss://:pw@redis.lan:6380/2?ssl_ca_certs=/ca.pem", "tenant-b", "p/w")
        == "rediss://tenant-b:p%2Fw@redis.lan:6380/2?ssl_ca_certs=/ca.pem"
    )
    assert client_url("redis://[::1]:7000", "tenant-c", "x") == "redis://tenant-c:x@[::1]:7000"


def test_secrets_are_labelled_and_json_has_them() -> None:
    s = Secrets("acme", "redis://tenant-acme:pw@h:1/0", "tok")
    text = show_secrets(s, "added", False)
    assert "client URL" in text and "redis://tenant-acme:pw@h:1/0" in text
    assert "HTTP token" in text and "tok" in text and "shown once" in text
    data = json.loads(show_secrets(s, "added", True, Quotas(max_queued=3)))
    assert data["client_url"] == s.client_url and data["http_token"] == "tok"
    assert data["quotas"]["max_queued"] == 3
    only_token = show_secrets(Secrets("acme", http_token="t2"), "rotated", False)
    assert "client URL" not in only_token and "t2" in only_token


def test_the_token_digest_is_sha256_hex() -> None:
    assert token_digest("abc") == hashlib.sha256(b"abc").hexdigest()
    TenantRecord(name="a", token_sha256=token_digest("abc"))  # the registry accepts it


def test_list_shows_quotas_and_never_secrets() -> None:
    digest = token_digest("the-token")
    records = {
        "acme": TenantRecord(
            name="acme",
            quotas=Quotas(max_queued=5, api_share={"calc": 0.5}, priority="low"),
            token_sha256=digest,
            created_s=1_700_000_000.0,
        ),
        "bee": TenantRecord(name="bee"),
    }
    table = show_list(records, {"tenant-acme"}, False)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["NAME", "PRIORITY", "MAX_QUEUED"]
    assert lines[1].split()[:3] == ["acme", "low", "5"] and "calc=0.5" in lines[1]
    assert "2023-11-14T22:13:20Z" in lines[1] and "MISSING" in lines[2]
    assert digest not in table
    data = json.loads(show_list(records, {"tenant-acme"}, True))
    assert [d["name"] for d in data] == ["acme", "bee"]
    assert data[0]["token_set"] and not data[1]["token_set"] and data[0]["redis_user"]
    assert digest not in json.dumps(data)
    assert "no tenants" in show_list({}, set(), False)
