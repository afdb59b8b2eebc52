"""The tenants' quotas as the scheduler applies them (issue 37).

`TenantBook` takes the registry (`Store.tenants()`, the operator's `tangram tenant` records)
as the loop reads it, about once a second (`SchedulerService.sync_tenants`), and
- gives the round each tenant's caps (`Round.tenancy`, `scheduler.tenancy`): cores, memory, GPU
  memory and API shares its running actions may hold; the round holds back what would go over;
- publishes each tenant's `max_queued` (`store.quota_side`), which its own submits check, so a
  tenant at its cap gets `AdmissionError` while the others submit on;
- sets the per-tenant action gauges (`tangram_tenant_actions{tenant,state}`: queued, running,
  held), labelled by tenant name only.

A tenant is its actions' job (`QueuedAction.job_id`, set to its name at intake); the `default`
tenant is never capped. A change of the registry reaches the round within a second.
"""

from __future__ import annotations

import logging
from collections import Counter

from scheduler.round import Round
from scheduler.service.books import ActionBook
from scheduler.tenancy import TenantCaps
from tangram_celery.common.metrics import SchedulerMetrics
from tangram_celery.common.tenants import DEFAULT, Quotas, TenantRecord, tenant_of
from tangram_celery.store import Store
from tangram_celery.store.quota_side import publish_limits

log = logging.getLogger("tangram.scheduler")

STATES = ("queued", "running", "held")


def caps_of(quotas: Quotas) -> TenantCaps:
    """The caps the round applies for `quotas` (its `max_queued` is checked at submit)."""
    return TenantCaps(
        cores=quotas.max_cores,
        memory_mb=quotas.max_memory_mb,
        gpu_memory_mb=quotas.max_gpu_memory_mb,
        api_share=dict(quotas.api_share),
    )


class TenantBook:
    """The registered tenants and what follows from their quotas (see the module doc)."""

    def __init__(self, store: Store, metrics: SchedulerMetrics) -> None:
        self.store, self.metrics = store, metrics
        self.records: dict[str, TenantRecord] = {}
        self._quotas: dict[str, Quotas] = {}  # as last given to the round
        self._published: dict[str, int] = {}  # tenant -> max_queued published (0: none)
        self._labels: set[str] = set()  # tenants the gauges carry

    def sync(
        self, rnd: Round, books: ActionBook | None = None, records: dict[str, TenantRecord] | None = None
    ) -> None:
        """Take the registry's `records` (read here if not given: the loop hands over its own
        read, `SchedulerService.sync_tenants`); give the round the caps, publish the
        `max_queued` that changed (every one at the first sync), and set the gauges."""
        self.records = records = self.store.tenants() if records is None else records
        quotas = {name: rec.quotas for name, rec in records.items() if name != DEFAULT}
        if quotas != self._quotas:
            rnd.tenancy.set_caps({name: caps_of(q) for name, q in quotas.items()})
            self._quotas = quotas
            log.info("tenant caps: %s", {n: q.model_dump(exclude_defaults=True) for n, q in quotas.items()})
        limits = {name: q.max_queued for name, q in quotas.items()}
        changed = {n: c for n, c in limits.items() if self._published.get(n) != c}
        changed |= {n: 0 for n in self._published if n not in limits}  # removed: its key goes
        if changed:
            publish_limits(self.store, changed)
        self._published = limits
        if books is not None:
            self.gauges(rnd, books)

    def gauges(self, rnd: Round, books: ActionBook) -> None:
        """`tangram_tenant_actions{tenant,state}`: each tenant's queued, running and held-back
        actions (the tenant is read from the qualified action id, never from a caller's field)."""
        counts: Counter[tuple[str, str]] = Counter()
        for qa in books.waiting.values():
            counts[tenant_of(qa.action_id), "queued"] += 1
        for aid in books.running_ids():
            counts[tenant_of(aid), "running"] += 1
        for job, n in rnd.tenancy.held.items():
            if job in self.records:
                counts[job, "held"] += n
        tenants = {DEFAULT} | set(self.records) | {t for t, _ in counts}
        gauge = self.metrics.tenant_actions
        for t in self._labels - tenants:  # a tenant removed: its series go
            for state in STATES:
                gauge.remove(t, state)
        for t in tenants:
            for state in STATES:
                gauge.labels(tenant=t, state=state).set(counts[t, state])
        self._labels = tenants
