"""What the scheduler publishes of each tenant's quotas for its clients to check at submit
(issue 37): `<prefix>limits` (`keys.limits_key`), a hash with `max_queued`, which the SUBMIT
script reads (by name: a read-only key cannot be a script's KEYS) and refuses a submit over
(`TANGRAM_FULL`). Only the scheduler
writes it; a tenant's Redis user may read its own (`transport.acl`). No key: no limit."""

from __future__ import annotations

from collections.abc import Mapping

from tangram_celery.store.base import StoreBase
from tangram_celery.store.keys import limits_key

MAX_QUEUED = "max_queued"


def publish_limits(store: StoreBase, max_queued: Mapping[str, int]) -> None:
    """For each tenant named: its `max_queued` written, or its limits key deleted when it has
    none (0). One round trip; idempotent."""
    if not max_queued:
        return
    items = list(max_queued.items())

    def write() -> None:  # a pipeline is spent once run: a retry builds it again
        pipe = store.r.pipeline(transaction=False)
        for tenant, cap in items:
            if cap > 0:
                pipe.hset(limits_key(tenant), MAX_QUEUED, cap)
            else:
                pipe.delete(limits_key(tenant))
        pipe.execute()

    store.retrying("publish tenant limits", write)
