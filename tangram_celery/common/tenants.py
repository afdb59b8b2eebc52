"""Tenants: who owns an action, and the names that follow from it (issue 37).

A tenant is the job identity of the work it submits. It is never a field a caller sets: the
scheduler takes it from the intake stream the action came on, and a tenant's Redis user can
write only its own streams and keys (`transport.acl`). Everything a tenant names is namespaced:

- its keys live under `prefix(tenant)`: `tangram:t:<name>:` (the `default` tenant keeps the
  single-tenant layout `tangram:`, so a deployment without tenants is unchanged, and an upgraded
  one finds its data as the `default` tenant's);
- between processes (Celery orders, sandbox keys, run log, reports) an action or trajectory id
  is qualified: `<name>/<id>` (`qualify`); the `default` tenant's ids stay bare. `/` is in no
  id a caller may give (`actions.ID_PATTERN`), so a qualified id is never a caller's id.

No I/O here: the registry's records (`TenantRecord`) are kept by `store.tenant_side` and the
`tangram tenant` commands.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tangram_celery.common.actions import _ID, SEP

DEFAULT = "default"
_TENANT = r"[a-z][a-z0-9-]{0,30}"
TENANT_PATTERN = f"^{_TENANT}$"
# an id between processes: a caller's id, qualified by its tenant unless that is `default`
QUALIFIED_PATTERN = f"^(?:{_TENANT}{SEP})?{_ID}$"
QUALIFIED_TRAJECTORY_PATTERN = f"^(?:(?:{_TENANT}{SEP})?{_ID})?$"  # "" for none
_TENANT_RE = re.compile(TENANT_PATTERN)
REDIS_USER_PREFIX = "tenant-"  # a tenant's Redis user: tenant-<name>
REGISTRY = "tangram:tenants"  # name -> TenantRecord JSON (the operator's; tenants cannot read it)

PriorityClass = Literal["low", "normal", "high"]
# a class's priority as the fair-share policy takes it (`actions.Priority`'s scale)
PRIORITY_OF_CLASS: dict[str, int] = {"low": -10, "normal": 0, "high": 10}


def valid_name(name: str) -> str:
    """`name` if it can name a tenant, else ValueError saying what a name looks like."""
    if not _TENANT_RE.match(name):
        raise ValueError(
            f"bad tenant name {name!r}: 1 to 31 characters, lowercase letters, digits and '-', "
            "starting with a letter"
        )
    return name


def prefix(tenant: str) -> str:
    """The prefix of every key of `tenant`'s work."""
    return "tangram:" if tenant == DEFAULT else f"tangram:t:{tenant}:"


def qualify(tenant: str, local_id: str) -> str:
    """The id between processes of `tenant`'s `local_id` ("" stays "": no trajectory)."""
    if tenant == DEFAULT or not local_id:
        return local_id
    return f"{tenant}{SEP}{local_id}"


def split(qualified: str) -> tuple[str, str]:
    """(tenant, the caller's own id) of a qualified id."""
    tenant, sep, local = qualified.partition(SEP)
    return (tenant, local) if sep else (DEFAULT, qualified)


def tenant_of(qualified: str) -> str:
    return split(qualified)[0]


def local(qualified: str) -> str:
    """The id as its caller gave it."""
    return split(qualified)[1]


def redis_user(tenant: str) -> str:
    return REDIS_USER_PREFIX + tenant


def tenant_of_user(username: str | None) -> str:
    """The tenant a broker URL's Redis user acts as: `tenant-<name>` is that tenant; any other
    user (an operator's or a role's, or none: the single-tenant deployment's password) acts as
    the `default` tenant."""
    if username and username.startswith(REDIS_USER_PREFIX):
        name = username[len(REDIS_USER_PREFIX) :]
        if _TENANT_RE.match(name):
            return name
    return DEFAULT


class Quotas(BaseModel):
    """What the operator lets a tenant use at once (0: no limit of that kind)."""

    model_config = ConfigDict(extra="forbid")

    max_queued: int = Field(0, ge=0)  # actions waiting in its intake
    max_cores: int = Field(0, ge=0)  # CPU cores its running actions hold
    max_memory_mb: int = Field(0, ge=0)  # memory its running actions hold
    max_gpu_memory_mb: int = Field(0, ge=0)  # GPU memory its running reward calls hold
    # API name -> the fraction of that API's quota (concurrency and rate) the tenant may use
    api_share: dict[str, float] = Field(default_factory=dict)
    priority: PriorityClass = "normal"


class TenantRecord(BaseModel):
    """A tenant as the registry keeps it (`REGISTRY`)."""

    model_config = ConfigDict(extra="forbid")

    v: Literal[1] = 1
    name: str = Field(pattern=TENANT_PATTERN)
    quotas: Quotas = Field(default_factory=Quotas)
    token_sha256: str = Field("", pattern=r"^([0-9a-f]{64})?$")  # its HTTP token's digest
    created_s: float = 0.0
