"""Quotas per tenant on a real deployment (issue 37): Redis, the scheduler, CPU and API workers.

The operator registers tenants with quotas; the scheduler publishes each tenant's queue cap
for its submits and holds back what would take a tenant over its share of an API. One tenant
at its limits is refused or held alone: the other goes on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_celery import ActionStatus, AdmissionError, ApiAction, CodeAction, TangramClient
from tangram_celery.common.tenants import Quotas, TenantRecord
from tangram_celery.store import Store
from tangram_celery.store.keys import limits_key

HANDLER = "tests.integration.test_tenant_quotas:span"


def span(request: dict[str, Any]) -> dict[str, Any]:
    """An API call that takes `sleep_s` and appends `<who> <start> <end>` to `log`."""
    start = time.time()
    time.sleep(float(request.get("sleep_s", 0.0)))
    line = f"{request['who']} {start:.6f} {time.time():.6f}\n"
    fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return {"who": request["who"]}


def _spans(log: Path, who: str) -> list[tuple[float, float]]:
    out = []
    for line in log.read_text().splitlines():
        w, start, end = line.split()
        if w == who:
            out.append((float(start), float(end)))
    return sorted(out)


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    now = most = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


@pytest.fixture
def admin(deployment: Any) -> Iterator[Store]:
    store = Store(deployment.url)
    yield store
    store.close()


def _register(admin: Store, *records: TenantRecord) -> None:
    """Register `records`, and wait for the scheduler to have read them (it publishes the
    queue cap of every one that has one within about a second)."""
    for rec in records:
        admin.put_tenant(rec)
    capped = [rec.name for rec in records if rec.quotas.max_queued]
    deadline = time.monotonic() + 10
    while not all(admin.r.exists(limits_key(n)) for n in capped):
        assert time.monotonic() < deadline, "the scheduler did not publish the tenants' limits"
        time.sleep(0.05)


def _client(deployment: Any, tenant: str) -> TangramClient:
    return TangramClient(deployment.url, tenant=tenant)


@pytest.mark.deploy(apis=[{"name": "slow", "handler": HANDLER, "max_concurrency": 4}], nodes={"cpu": []})
def test_an_api_share_holds_its_tenant_alone(deployment: Any, admin: Store, tmp_path: Path) -> None:
    """Given an API of 4 concurrent calls and tenant a allowed a quarter of it, a's calls run
    one at a time while tenant b's run side by side; every call completes."""
    _register(
        admin,
        TenantRecord(name="a", quotas=Quotas(max_queued=100, api_share={"slow": 0.25})),
        TenantRecord(name="b", quotas=Quotas(max_queued=100)),
    )
    log = tmp_path / "spans.log"
    a, b = _client(deployment, "a"), _client(deployment, "b")
    try:
        req = {"log": str(log), "sleep_s": 0.5}
        ha = [
            a.submit(ApiAction(trajectory_id="t", api="slow", request={**req, "who": "a"})) for _ in range(3)
        ]
        hb = [
            b.submit(ApiAction(trajectory_id="t", api="slow", request={**req, "who": "b"})) for _ in range(3)
        ]
        for h in ha + hb:
            assert h.result(timeout=60).status is ActionStatus.OK
    finally:
        a.close()
        b.close()
    assert _most_at_once(_spans(log, "a")) == 1
    assert _most_at_once(_spans(log, "b")) >= 2


@pytest.mark.deploy(apis=[{"name": "slow", "handler": HANDLER, "max_concurrency": 1}], nodes={"cpu": []})
def test_a_tenant_at_its_queue_cap_is_refused_and_another_submits(
    deployment: Any, admin: Store, tmp_path: Path
) -> None:
    """Given tenant a allowed 2 queued actions behind a long call, its next submits are refused
    with AdmissionError while tenant b, with no cap, submits 5; every accepted call completes."""
    _register(admin, TenantRecord(name="a", quotas=Quotas(max_queued=2)), TenantRecord(name="b"))
    log = tmp_path / "spans.log"
    a, b = _client(deployment, "a"), _client(deployment, "b")
    try:
        first = a.submit(
            ApiAction(trajectory_id="t", api="slow", request={"log": str(log), "who": "a", "sleep_s": 3})
        )
        accepted = [first]
        with pytest.raises(AdmissionError):
            for _ in range(5):
                req = {"log": str(log), "who": "a", "sleep_s": 0.0}
                accepted.append(a.submit(ApiAction(trajectory_id="t", api="slow", request=req)))
        assert 2 <= len(accepted) <= 3  # its cap (2 queued), and the call that ran meanwhile
        others = [
            b.submit(ApiAction(trajectory_id="u", api="slow", request={"log": str(log), "who": "b"}))
            for _ in range(5)
        ]
        for h in accepted + others:
            assert h.result(timeout=60).status is ActionStatus.OK
    finally:
        a.close()
        b.close()
    assert len(_spans(log, "a")) == len(accepted) and len(_spans(log, "b")) == 5


_TIMED = "import time\nt0 = time.time()\ntime.sleep(1.0)\nprint(t0, time.time())"


def test_a_core_cap_runs_its_tenants_code_one_at_a_time(deployment: Any, admin: Store) -> None:
    """Given a 2-core node and tenant a allowed 1 core, a's two code actions run one after the
    other while tenant b's action runs beside the first of them."""
    _register(
        admin, TenantRecord(name="a", quotas=Quotas(max_queued=10, max_cores=1)), TenantRecord(name="b")
    )
    a, b = _client(deployment, "a"), _client(deployment, "b")
    try:
        ha = [a.submit(CodeAction(trajectory_id=f"t{i}", code=_TIMED)) for i in range(2)]
        hb = b.submit(CodeAction(trajectory_id="t0", code=_TIMED))
        results = [h.result(timeout=120) for h in [*ha, hb]]
    finally:
        a.close()
        b.close()
    assert all(r.status is ActionStatus.OK for r in results), [r.error for r in results]
    spans = [tuple(float(x) for x in r.stdout.split()) for r in results]
    assert _most_at_once(sorted(spans[:2])) == 1  # a: one core, one at a time
    assert _most_at_once(sorted(spans)) == 2  # b ran beside one of a's
