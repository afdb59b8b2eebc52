"""Who may call the HTTP server, as pure policy (no ASGI, no clock of its own): the Host check
that closes DNS rebinding, the bearer token mapped to a principal, the query-string token only
when the operator opts in, and a token bucket per principal. `app.Guard` asks `Access.check`
once per request and answers the `Refusal` it gets, if any.

Tokens are kept only as SHA-256 digests and a presented one is compared with every digest in
constant time. The tenants' tokens come from the registry (stored there as digests) and are
replaced as a whole when it changes (`Access.set_tenants`): a new, rotated or removed tenant's
token counts from the next refresh (`tenancy.Tenancy`), without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
from dataclasses import dataclass, field

from tangram_celery.common.config_front import HttpConfig
from tangram_celery.common.tenants import DEFAULT

# ping and the OpenAPI docs need no token (SandboxFusion's clients ping first)
PUBLIC_PATHS = frozenset({"/v1/ping", "/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc"})
QUERY_KEY = b"token"


@dataclass(frozen=True)
class Principal:
    """Whom a request acts for, and as which tenant: the operator's token's holder and (with
    `http.auth: none`) any local caller act as the `default` tenant; a tenant's token's holder
    as that tenant (`Principal(name, name)`)."""

    name: str
    tenant: str = DEFAULT


LOOPBACK_CALLER = Principal("loopback")  # http.auth: none
OPERATOR = Principal("default")  # the holder of http.token
ANYONE = Principal("public")  # GET /v1/ping and the docs


def tenant_principal(name: str) -> Principal:
    return Principal(name, name)


@dataclass(frozen=True)
class Refusal:
    status: int
    detail: str
    headers: tuple[tuple[str, str], ...] = ()
    unknown_token: bool = False  # a token was presented and matched none (a tenant added since?)


def digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


class Tokens:
    """Presented token -> principal. Only digests are kept; `principal_for` compares the
    presented token's digest with every stored one (no early exit), in constant time each."""

    def __init__(self) -> None:
        self._entries: list[tuple[bytes, Principal]] = []

    def add(self, token: str | bytes, principal: Principal = OPERATOR) -> None:
        self.add_digest(digest(token), principal)

    def add_digest(self, sha256: bytes, principal: Principal) -> None:
        self._entries.append((sha256, principal))

    def __len__(self) -> int:
        return len(self._entries)

    def principal_for(self, presented: bytes) -> Principal | None:
        mine = digest(presented)
        found = None
        for stored, principal in self._entries:
            if hmac.compare_digest(mine, stored) and found is None:
                found = principal
        return found


def host_name(header: bytes) -> str:
    """The host part of a Host header, lower case, without port, brackets or a final dot."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):  # [::1]:8080
        return text[1 : text.find("]")] if "]" in text else text
    if text.count(":") == 1:
        text = text.split(":", 1)[0]
    return text.rstrip(".")


def is_loopback_name(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(header: bytes | None, loopback_listener: bool, allowed: frozenset[str]) -> bool:
    """A request's Host is one this listener answers for. Loopback listener: a loopback address
    or `localhost` (any port), or one of `allowed`; elsewhere: one of `allowed` (or a loopback
    one) when `allowed` is set, else any. A request without Host is no browser's (browsers
    always send it), so it cannot be rebinding and is let through."""
    if header is None:
        return True
    name = host_name(header)
    if name in allowed or is_loopback_name(name):
        return True
    return not loopback_listener and not allowed


def query_token(query: bytes) -> bytes | None:
    """The value of `token=` in a query string, raw (percent-decoded), or None."""
    from urllib.parse import unquote_to_bytes

    for part in query.split(b"&"):
        key, _, value = part.partition(b"=")
        if unquote_to_bytes(key) == QUERY_KEY:
            return unquote_to_bytes(value.replace(b"+", b" "))
    return None


@dataclass
class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; `take` spends one."""

    rate: float
    burst: float
    level: float = -1.0
    at: float = 0.0

    def take(self, now: float) -> float:
        """0 when a token was spent, else the seconds until one will be there."""
        if self.level < 0:  # a new bucket starts full
            self.level, self.at = self.burst, now
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level >= 1.0:
            self.level -= 1.0
            return 0.0
        return (1.0 - self.level) / self.rate


@dataclass
class RateLimit:
    """One token bucket per principal, so per tenant (principals are the configured tokens and
    the registry's tenants: a bounded set)."""

    rate: float
    burst: float
    buckets: dict[Principal, TokenBucket] = field(default_factory=dict)

    def wait_s(self, principal: Principal, now: float) -> float:
        bucket = self.buckets.get(principal)
        if bucket is None:
            bucket = self.buckets[principal] = TokenBucket(self.rate, self.burst)
        return bucket.take(now)


@dataclass
class Access:
    """The request policy of one listener (from `HttpConfig`)."""

    tokens: Tokens | None  # None: no token needed (http.auth: none, loopback only)
    loopback: bool
    allowed_hosts: frozenset[str] = frozenset()
    token_in_query: bool = False
    rate: RateLimit | None = None
    tenant_tokens: Tokens = field(default_factory=Tokens)  # the registry's, by tenant

    def set_tenants(self, digests: dict[str, str]) -> None:
        """The tenants' tokens from now on: tenant name -> hex SHA-256 of its token (a tenant
        without a token is not listed). Replaced as a whole: a token left out stops working."""
        tokens = Tokens()
        for name, hex_digest in sorted(digests.items()):
            if hex_digest:
                tokens.add_digest(bytes.fromhex(hex_digest), tenant_principal(name))
        self.tenant_tokens = tokens

    @classmethod
    def of(cls, http: HttpConfig, token: str | None) -> Access:
        """`token`: the resolved http.token (or the generated one); None only with auth none."""
        tokens = None
        if http.auth == "token":
            tokens = Tokens()
            if token:
                tokens.add(token)
        rate = None
        if http.rate_limit_per_s > 0:
            rate = RateLimit(http.rate_limit_per_s, http.burst)
        hosts = frozenset(host_name(h.encode()) for h in http.allowed_hosts)
        return cls(tokens, http.loopback, hosts, http.token_in_query, rate)

    def check(
        self, path: str, host: bytes | None, authorization: bytes | None, query: bytes, now: float
    ) -> Principal | Refusal:
        """The principal this request acts for, or why it is refused (in this order: Host,
        a token in the query string, the token, the rate)."""
        if not host_allowed(host, self.loopback, self.allowed_hosts):
            return Refusal(
                403,
                f"Host {host_name(host or b'')!r} is not served here: a loopback server answers only "
                "localhost and loopback addresses (DNS rebinding); add the name to http.allowed_hosts",
            )
        in_query = query_token(query) if QUERY_KEY in query else None
        if in_query is not None and not self.token_in_query:
            return Refusal(
                403,
                "a token in the query string is not accepted here (it ends up in logs and histories): "
                "send 'Authorization: Bearer TOKEN', or the operator sets http.token_in_query: true",
            )
        if path in PUBLIC_PATHS:
            return ANYONE
        presented = _presented(authorization, in_query)
        principal = self._principal(presented)
        if principal is None:
            challenge = (("www-authenticate", "Bearer"),)
            return Refusal(
                401, "missing or wrong bearer token", challenge, unknown_token=presented is not None
            )
        if self.rate is not None:
            wait = self.rate.wait_s(principal, now)
            if wait > 0:
                retry = str(max(1, math.ceil(wait)))
                detail = f"rate limit of {self.rate.rate:g} requests/s (burst {self.rate.burst:g}) reached"
                return Refusal(429, detail, (("retry-after", retry),))
        return principal

    def _principal(self, presented: bytes | None) -> Principal | None:
        """The presented token's principal: the operator's token, else a tenant's. With
        `http.auth: none` a tenant's token still acts as its tenant, anything else (no token,
        or another) as the local caller, the `default` tenant."""
        found = None if presented is None else self.tenant_tokens.principal_for(presented)
        if self.tokens is None:
            return found or LOOPBACK_CALLER
        if presented is None:
            return None
        return self.tokens.principal_for(presented) or found


def _presented(authorization: bytes | None, in_query: bytes | None) -> bytes | None:
    """The token a request presents: the bearer header's, else the query string's (only
    reached, not refused, when http.token_in_query); None for none or another scheme."""
    if authorization is None:
        return in_query
    return authorization[7:].strip() if authorization[:7].lower() == b"bearer " else None
