"""The HTTP access policy (`tangram_celery/web/auth.py`), pure: Host check, tokens, the
query-string token, the rate limit, and the config rules around them (issue 37)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tangram_celery.common.config import parse_config
from tangram_celery.common.config_front import HttpConfig
from tangram_celery.common.errors import ConfigError
from tangram_celery.web.auth import (
    ANYONE,
    LOOPBACK_CALLER,
    OPERATOR,
    Access,
    Principal,
    RateLimit,
    Refusal,
    TokenBucket,
    Tokens,
    digest,
    host_allowed,
    host_name,
    query_token,
)

pytestmark = pytest.mark.unit
BEARER = b"Bearer s3cret"


def test_host_names_are_parsed_without_port_brackets_or_case() -> None:
    assert host_name(b"127.0.0.1:8080") == "127.0.0.1"
    assert host_name(b"LocalHost:1") == "localhost"
    assert host_name(b"[::1]:8080") == "::1"
    assert host_name(b"[::1]") == "::1"
    assert host_name(b"evil.example.com.:80") == "evil.example.com"


def test_a_loopback_listener_answers_only_loopback_names_and_listed_ones() -> None:
    """DNS rebinding: a browser page at evil.example.com, resolved to 127.0.0.1, sends its own
    name as Host; the loopback listener refuses it unless the operator listed it."""
    for ok in (b"127.0.0.1:5000", b"localhost", b"localhost:5000", b"[::1]:5000", b"127.0.0.2"):
        assert host_allowed(ok, True, frozenset()), ok
    for bad in (b"evil.example.com", b"evil.example.com:5000", b"10.0.0.1", b"localhost.evil.com"):
        assert not host_allowed(bad, True, frozenset()), bad
    assert host_allowed(b"tangram.lan:80", True, frozenset({"tangram.lan"}))
    assert host_allowed(None, True, frozenset())  # no browser sends a request without Host


def test_other_listeners_check_hosts_only_when_listed() -> None:
    assert host_allowed(b"anything.example", False, frozenset())
    assert host_allowed(b"api.example:443", False, frozenset({"api.example"}))
    assert host_allowed(b"127.0.0.1:8080", False, frozenset({"api.example"}))  # in-container probes
    assert not host_allowed(b"other.example", False, frozenset({"api.example"}))


def test_query_tokens_are_found_and_decoded() -> None:
    assert query_token(b"token=a%2Fb") == b"a/b"
    assert query_token(b"wait=false&token=x") == b"x"
    assert query_token(b"tokens=x&wait_s=1") is None
    assert query_token(b"") is None


def test_tokens_map_to_principals_by_digest() -> None:
    """Only digests are kept; tenant tokens (stored hashed) slot in with add_digest."""
    tokens = Tokens()
    tokens.add("s3cret")
    tokens.add_digest(digest("tenant-a-token"), Principal("a"))
    assert tokens.principal_for(b"s3cret") == OPERATOR
    assert tokens.principal_for(b"tenant-a-token") == Principal("a")
    assert tokens.principal_for(b"s3cre") is None
    assert tokens.principal_for(b"") is None
    assert b"s3cret" not in repr(tokens._entries).encode()


def test_a_token_bucket_allows_its_burst_then_its_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3.0)
    assert [bucket.take(10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(10.0) == pytest.approx(0.5)
    assert bucket.take(10.5) == 0.0  # one token came back in 0.5 s
    assert bucket.take(10.5) > 0
    assert bucket.take(100.0) == 0.0  # never more than the burst saved up
    assert [bucket.take(100.0) for _ in range(3)][-1] > 0


def test_each_principal_has_its_own_bucket() -> None:
    limit = RateLimit(rate=1.0, burst=1.0)
    assert limit.wait_s(Principal("a"), 0.0) == 0.0
    assert limit.wait_s(Principal("a"), 0.0) > 0
    assert limit.wait_s(Principal("b"), 0.0) == 0.0


def _access(**http: object) -> Access:
    cfg = HttpConfig.model_validate(http)
    return Access.of(cfg, None if cfg.auth == "none" else "s3cret")


def test_the_checks_answer_401_403_and_429_with_reasons() -> None:
    access = _access(rate_limit_per_s=1.0, rate_limit_burst=2)
    host = b"127.0.0.1:8000"
    refused = access.check("/run_code", b"evil.example.com", BEARER, b"", 0.0)
    assert isinstance(refused, Refusal) and refused.status == 403 and "rebinding" in refused.detail
    no_token = access.check("/run_code", host, None, b"", 0.0)
    assert isinstance(no_token, Refusal) and no_token.status == 401
    wrong = access.check("/run_code", host, b"Bearer nope", b"", 0.0)
    assert isinstance(wrong, Refusal) and wrong.status == 401
    basic = access.check("/run_code", host, b"Basic czNjcmV0", b"", 0.0)
    assert isinstance(basic, Refusal) and basic.status == 401
    in_query = access.check("/run_code", host, None, b"token=s3cret", 0.0)
    assert isinstance(in_query, Refusal) and in_query.status == 403
    assert "token_in_query" in in_query.detail and "s3cret" not in in_query.detail
    assert access.check("/v1/ping", host, None, b"", 0.0) == ANYONE  # ping and docs: no token
    assert access.check("/run_code", host, BEARER, b"", 0.0) == OPERATOR
    assert access.check("/run_code", host, BEARER, b"", 0.0) == OPERATOR
    limited = access.check("/run_code", host, BEARER, b"", 0.0)
    assert isinstance(limited, Refusal) and limited.status == 429
    assert dict(limited.headers) == {"retry-after": "1"}
    assert access.check("/v1/ping", host, None, b"", 0.0) == ANYONE  # ping is not limited
    assert access.check("/run_code", host, BEARER, b"", 1.0) == OPERATOR


def test_a_query_token_counts_only_when_the_operator_opts_in() -> None:
    access = _access(token_in_query=True)
    host = b"localhost"
    assert access.check("/run_code", host, None, b"token=s3cret", 0.0) == OPERATOR
    wrong = access.check("/run_code", host, None, b"token=nope", 0.0)
    assert isinstance(wrong, Refusal) and wrong.status == 401


def test_no_token_only_by_the_explicit_setting_and_only_on_loopback() -> None:
    assert _access(auth="none").check("/run_code", b"127.0.0.1", None, b"", 0.0) == LOOPBACK_CALLER
    still_host = _access(auth="none").check("/run_code", b"evil.example.com", None, b"", 0.0)
    assert isinstance(still_host, Refusal) and still_host.status == 403
    no_token = Access.of(HttpConfig(), None)  # auth: token but none given: everything refused
    refused = no_token.check("/run_code", b"127.0.0.1", b"Bearer ", b"", 0.0)
    assert isinstance(refused, Refusal) and refused.status == 401
    with pytest.raises(ConfigError, match="only on loopback"):
        parse_config({"http": {"address": "0.0.0.0", "auth": "none"}})
    with pytest.raises(ConfigError, match="contradict"):
        parse_config({"http": {"auth": "none", "token": "x"}})
    assert HttpConfig().auth == "token" and not HttpConfig().token_in_query
    assert HttpConfig(rate_limit_per_s=0.2).burst == 1.0
    assert HttpConfig(rate_limit_per_s=5, rate_limit_burst=7).burst == 7.0


def test_the_server_makes_a_private_token_and_keeps_it(tmp_path: Path) -> None:
    """No http.token, auth token: <state_dir>/http.token, mode 0600, the same across restarts."""
    from tangram_celery.web.serve import server_token

    cfg = parse_config({"state_dir": str(tmp_path / "state")})
    token, path = server_token(cfg)
    assert token and len(token) >= 32 and path == tmp_path / "state" / "http.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    assert server_token(cfg) == (token, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert server_token(parse_config({"http": {"auth": "none"}})) == (None, None)
    assert server_token(parse_config({"http": {"token": "given"}})) == ("given", None)
