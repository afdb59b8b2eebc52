"""The tenant registry in the store (`common.tenants.REGISTRY`): the operator's `tangram tenant`
commands write it; the scheduler and the HTTP server read it. Tenants' own Redis users cannot
read it (`transport.acl`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from tangram_celery.common.tenants import REGISTRY, TenantRecord
from tangram_celery.store.base import StoreBase
from tangram_celery.store.calls import Call

log = logging.getLogger("tangram.store")


def records_of(raw: Mapping[Any, Any]) -> dict[str, TenantRecord]:
    """The registry's hash parsed (str or bytes); an unreadable record is logged and left out
    (its tenant's work then waits, it is never given another tenant's identity)."""
    out: dict[str, TenantRecord] = {}
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else str(key)
        try:
            rec = TenantRecord.model_validate_json(value)
        except ValidationError as e:
            log.error("tenant record %r unreadable, left out: %s", name, e)
            continue
        if rec.name != name:
            log.error("tenant record under %r names %r, left out", name, rec.name)
            continue
        out[name] = rec
    return out


def read_tenants() -> Call[dict[str, TenantRecord]]:
    """The registry, as a call for either executor (the HTTP server reads it on `AsyncStore`)."""
    return Call("read tenants", "hgetall", (REGISTRY,), records_of)


class TenantSide(StoreBase):
    def tenants(self) -> dict[str, TenantRecord]:
        """Every registered tenant, by name."""
        return self.run(read_tenants())

    def put_tenant(self, record: TenantRecord) -> None:
        """Add or replace `record` (its name is the field)."""
        self.retrying("write tenant", lambda: self.r.hset(REGISTRY, record.name, record.model_dump_json()))

    def remove_tenant(self, name: str) -> bool:
        """Drop `name`'s record; False if it had none."""
        return bool(self.retrying("remove tenant", lambda: self.r.hdel(REGISTRY, name)))
