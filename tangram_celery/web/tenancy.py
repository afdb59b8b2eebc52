"""The tenants the HTTP server acts for (issue 37).

Each request acts as the tenant its token names (`auth.Principal.tenant`): through that
tenant's own `AsyncTangramClient(tenant=...)` and `Gate`, made at its first request, so the ids
a request names are that tenant's own and another tenant's id is simply not found (404). The
server's Redis user (`http`) may act for every tenant; the token decides which one it does.

The registry's token digests are read every `REFRESH_S` into the access policy, so a tenant
added, rotated or removed with `tangram tenant` counts within seconds, without a restart. A
token that matches nothing has the registry read once more before it is refused (`reread`: a
tenant added since the last read works at its first request), at most every `REREAD_GAP_S`, so
a caller trying tokens cannot turn into a load on Redis. A removed tenant's client is closed
once its last request has ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tangram_celery.client.aio import AsyncTangramClient
from tangram_celery.client.gate import Gate
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.tenants import DEFAULT
from tangram_celery.store.tenant_side import read_tenants
from tangram_celery.web.auth import Access, Principal

log = logging.getLogger("tangram.web")
REFRESH_S = 2.0
REREAD_GAP_S = 0.5  # the shortest time between two reads for unknown tokens
READ_TIMEOUT_S = 10.0  # a read that hangs (a half-open connection) is given up and tried again

ClientFactory = Callable[[str], AsyncTangramClient]


def tenant_of_scope(scope: object) -> str:
    """The tenant a request acts as (the `default` one when no principal was set)."""
    state = scope.get("state") if isinstance(scope, dict) else None
    principal = state.get("principal") if isinstance(state, dict) else None
    return principal.tenant if isinstance(principal, Principal) else DEFAULT


class Tenancy:
    """One client and gate per tenant, and the registry's tokens in `access`."""

    def __init__(self, cfg: TangramConfig, access: Access, default: Gate, make_client: ClientFactory) -> None:
        self.cfg = cfg
        self.access = access
        self.make_client = make_client
        self.gates: dict[str, Gate] = {DEFAULT: default}
        self.known: set[str] = set()  # registered tenants, as last read
        self._refresher: asyncio.Task[None] | None = None
        self._reading = asyncio.Lock()  # one read at a time
        self._read_started = float("-inf")  # monotonic time the last read began
        self._reread_at = float("-inf")  # ... and the last one for an unknown token

    def gate(self, tenant: str) -> Gate:
        """`tenant`'s gate (its client is made at its first request)."""
        gate = self.gates.get(tenant)
        if gate is None:
            gate = self.gates[tenant] = Gate(self.make_client(tenant), self.cfg.http)
        return gate

    async def refresh(self) -> None:
        """Read the registry once: its tokens into the access policy; the clients of tenants no
        longer in it are closed once idle."""
        async with self._reading:
            await self._read()

    async def reread(self) -> None:
        """Read the registry for a token that matched nothing, unless a read began since the
        request came or another unknown token had it read less than `REREAD_GAP_S` before (a
        failed read leaves the tokens as they were: the request is refused as it would have
        been)."""
        asked = time.monotonic()
        async with self._reading:
            if self._read_started >= asked or asked - self._reread_at < REREAD_GAP_S:
                return
            self._reread_at = asked
            try:
                await self._read()
            except Exception as e:
                log.warning("tenant registry not read for an unknown token: %s", e)

    async def _read(self) -> None:
        self._read_started = time.monotonic()
        async with asyncio.timeout(READ_TIMEOUT_S):
            records = await self.gates[DEFAULT].client.store.run(read_tenants())
        if set(records) != self.known:
            log.info("tenants: %s", ", ".join(sorted(records)) or "none")
        self.access.set_tenants({name: rec.token_sha256 for name, rec in records.items()})
        self.known = set(records)
        for name in [n for n in self.gates if n != DEFAULT and n not in self.known]:
            gate = self.gates[name]
            if gate.in_flight == 0:
                del self.gates[name]
                await gate.client.close()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except Exception as e:  # the last tokens stay in force until the next read works
                log.warning("tenant registry not read: %s", e)

    async def start(self) -> None:
        try:
            await self.refresh()
        except Exception as e:
            log.warning("tenant registry not read at start (only the deployment's token works): %s", e)
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop(), name="tenants")

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for name, gate in list(self.gates.items()):
            if name != DEFAULT:  # the default client is closed by its owner
                await gate.client.close()
        self.gates = {DEFAULT: self.gates[DEFAULT]}

    # ---- what the gauges sum -------------------------------------------------------------
    def in_flight(self) -> int:
        return sum(g.in_flight for g in self.gates.values())

    def overloaded_total(self) -> int:
        return sum(g.overloaded_total for g in self.gates.values())

    def awaited(self) -> int:
        return sum(g.client.outstanding for g in self.gates.values())
