"""The broker's settings (`broker`): which Redis, the embedded one's data and limits, and TLS
with a CA and a client certificate for a Redis on another host (`broker.tls`, issue 37;
docs/operations.md, TLS across hosts)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from tangram_celery.common.config_front import StrictModel


class BrokerTlsConfig(StrictModel):
    """TLS to a `rediss://` broker: which CA to trust, and the client certificate to show."""

    ca_file: str | None = Field(
        None,
        description="PEM file of the CA(s) that signed the Redis server's certificate "
        "(default: the system's trusted CAs)",
    )
    cert_file: str | None = Field(
        None, description="PEM client certificate, for a server that checks clients (tls-auth-clients yes)"
    )
    key_file: str | None = Field(None, description="PEM private key of cert_file (keep it 0600)")

    @model_validator(mode="after")
    def _pair(self) -> BrokerTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("broker.tls: give both cert_file and key_file, or neither")
        return self


class BrokerConfig(StrictModel):
    url: str = Field(
        "embedded",
        description="'embedded' to start a private redis-server, or a redis[s]://[:password@]host:port/db URL",
    )
    data_dir: str = Field(".tangram/redis", description="directory for the embedded Redis AOF")
    maxmemory_mb: int = Field(
        2048,
        ge=64,
        description=(
            "embedded Redis memory ceiling, MiB (noeviction: nothing is ever dropped); submits are "
            "refused with AdmissionError above `admit_memory_fraction` of it"
        ),
    )
    admit_memory_fraction: float = Field(
        0.8,
        gt=0,
        le=0.95,
        description="share of Redis maxmemory above which submit fails fast (the rest is headroom "
        "for results and scheduling)",
    )
    fsync: Literal["always", "everysec"] = Field(
        "everysec",
        description=(
            "embedded Redis AOF fsync: 'everysec' (Redis writes the AOF before replying, so a "
            "killed Redis process normally loses nothing; an OS crash, or a disk so slow that "
            "Redis postpones writes, can lose 1-2 s) or 'always' (nothing lost even then, several "
            "ms per write)"
        ),
    )
    tls: BrokerTlsConfig | None = Field(
        None, description="TLS settings of a rediss:// broker.url: ca_file, cert_file, key_file"
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v != "embedded" and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                "use 'embedded' or a redis://host:port/db URL (${VAR} is taken from the environment)"
            )
        return v

    @model_validator(mode="after")
    def _tls_needs_rediss(self) -> BrokerConfig:
        if self.tls is not None and not self.url.startswith("rediss://"):
            raise ValueError(f"broker.tls is set but broker.url {self.url!r} is not a rediss:// URL")
        return self
