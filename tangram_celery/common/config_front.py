"""The front door's settings: the HTTP server (`tangram serve`) and the caps on what one action
may carry (checked at submit). Part of the deployment config (`tangram_celery.common.config`)."""

from __future__ import annotations

import math
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tangram_celery.common.errors import ConfigError


class StrictModel(BaseModel):
    """The base of every config model: unknown keys are refused, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class HttpConfig(StrictModel):
    """The HTTP front door (`tangram serve`): SandboxFusion-compatible and native endpoints."""

    enabled: bool = Field(True, description="`tangram up` starts the HTTP server (needs the 'http' extra)")
    address: str = Field("127.0.0.1", description="listen address; any address but loopback requires a token")
    port: int = Field(0, ge=0, le=65535, description="listen port (0 picks a free one)")
    token: str | None = Field(
        None,
        description="bearer token every request but GET /v1/ping must carry (Authorization: Bearer "
        "TOKEN); ${VAR} is taken from the environment. Unset on loopback: the server makes one and "
        "keeps it in <state_dir>/http.token (mode 0600)",
    )
    auth: Literal["token", "none"] = Field(
        "token", description="'none': no token at all, allowed only on a loopback address"
    )
    token_in_query: bool = Field(
        False, description="also accept ?token=TOKEN (clients that cannot send headers); else 403"
    )
    allowed_hosts: tuple[str, ...] = Field(
        (),
        description="Host names served besides localhost and loopback addresses; off loopback, when "
        "set, only these (and loopback ones)",
    )
    rate_limit_per_s: float = Field(
        0.0, ge=0, description="requests a second per token (0: no limit); beyond, 429 + Retry-After"
    )
    rate_limit_burst: int = Field(
        0,
        ge=0,
        description="requests a token may make at once above the rate (0: twice the rate, at least 1)",
    )
    max_in_flight: int = Field(
        4096, ge=1, le=1_000_000, description="requests served at once; beyond it the overload status"
    )
    slack_s: float = Field(
        8.0,
        gt=0,
        le=3600,
        description="a request is answered within compile + run timeout + slack_s seconds "
        "(verl's client waits compile + run + 10 s)",
    )
    exec_margin_s: float = Field(
        2.0,
        ge=0,
        le=600,
        description="time an action may need beyond its own timeouts (sandbox start, runner): an "
        "action not started by the deadline minus its timeouts minus this margin is cancelled",
    )
    overload_status: Literal[429, 503, 504] = Field(
        504, description="HTTP status of an overload answer (verl's client retries 504 only)"
    )
    max_body_mb: int = Field(64, ge=1, le=4096, description="largest request body, MiB")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        import ipaddress

        if v != "localhost":
            try:
                ipaddress.ip_address(v)
            except ValueError:
                raise ValueError(f"{v!r} is not an IP address (or 'localhost')") from None
        return v

    @model_validator(mode="after")
    def _token_off_loopback(self) -> HttpConfig:
        if self.auth == "none" and not self.loopback:
            raise ValueError(
                f"http.auth: none serves without a token, so only on loopback, not {self.address}"
            )
        if not self.loopback and not self.token:
            raise ValueError(
                f"http.address {self.address} is reachable from other hosts: set http.token "
                "(e.g. token: ${TANGRAM_HTTP_TOKEN}) or bind 127.0.0.1"
            )
        if self.auth == "none" and self.token:
            raise ValueError("http.auth: none and http.token contradict each other: drop one")
        if self.exec_margin_s >= self.slack_s:
            raise ValueError(
                f"http.exec_margin_s ({self.exec_margin_s}) must be below http.slack_s ({self.slack_s}): "
                "their difference is how long a request may wait in the queue"
            )
        return self

    @property
    def loopback(self) -> bool:
        import ipaddress

        return self.address == "localhost" or ipaddress.ip_address(self.address).is_loopback

    @property
    def burst(self) -> float:
        """The rate limit's bucket size."""
        return float(self.rate_limit_burst or max(1, math.ceil(2 * self.rate_limit_per_s)))

    def resolved_token(self) -> str | None:
        """The token with ${VAR} taken from the environment (ConfigError if VAR is unset)."""
        if self.token is None:
            return None
        return expand_env(self.token, "http.token")


def expand_env(value: str, key: str) -> str:
    """`value` with each ${VAR} replaced from the environment; ConfigError names an unset VAR."""
    import re

    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in os.environ:
            raise ConfigError(f"{key}: environment variable {name} is not set")
        return os.environ[name]

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", sub, value)


class LimitsConfig(StrictModel):
    """Caps on what one action may carry, checked at submit (ActionRejected, nothing enqueued).

    Payloads go to Redis as they are, so these bound the broker's memory per action; the
    broker's own ceiling (`broker.maxmemory_mb`) turns a flood into AdmissionError."""

    max_code_bytes: int = Field(1 << 20, ge=1024, description="code, UTF-8 bytes")
    max_stdin_bytes: int = Field(8 << 20, ge=0, description="stdin of a code action, UTF-8 bytes")
    max_files: int = Field(256, ge=0, description="number of `files` entries of a code action")
    max_files_bytes: int = Field(16 << 20, ge=0, description="all `files` contents together, UTF-8 bytes")
    max_test_cases: int = Field(10_000, ge=1, le=100_000, description="test cases of one action")
    max_test_field_bytes: int = Field(
        1 << 20, ge=1024, description="one test case's stdin, expected_stdout or assert_code, bytes"
    )
    max_payload_bytes: int = Field(64 << 20, ge=1 << 16, description="one action as JSON, bytes")
    max_json_depth: int = Field(64, ge=1, le=200, description="nesting of API requests / reward inputs")
    queued_ttl_s: float = Field(
        86400.0, gt=0, description="a payload not run within this many seconds expires (s)"
    )
