"""The HTTP server per tenant (issue 37), in front of stand-in clients: a token resolves to its
tenant (the registry's digests, re-read: a rotated or removed token stops working), each
tenant acts through its own client so another tenant's id is 404, the rate limit is per
tenant, and an intake refusal is 429 (a limit) or 503 (the broker full) with its reason."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.config import parse_config
from tangram_celery.common.config_front import HttpConfig
from tangram_celery.common.errors import AdmissionError
from tangram_celery.common.tenants import TenantRecord
from tangram_celery.common.wire import ActionResult
from tangram_celery.web.auth import LOOPBACK_CALLER, OPERATOR, Access, Principal, Refusal

pytestmark = pytest.mark.unit
HOST = b"127.0.0.1:8000"


def _hex(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _access(**http: object) -> Access:
    cfg = HttpConfig.model_validate(http)
    return Access.of(cfg, None if cfg.auth == "none" else "operator-token")


def test_a_tenants_token_acts_as_its_tenant_and_the_operators_as_default() -> None:
    access = _access()
    access.set_tenants({"acme": _hex("acme-token"), "bee": _hex("bee-token"), "nokey": ""})
    acme = access.check("/run_code", HOST, b"Bearer acme-token", b"", 0.0)
    assert acme == Principal("acme", "acme") and acme.tenant == "acme"
    assert access.check("/run_code", HOST, b"Bearer bee-token", b"", 0.0) == Principal("bee", "bee")
    op = access.check("/run_code", HOST, b"Bearer operator-token", b"", 0.0)
    assert op == OPERATOR and op.tenant == "default"
    wrong = access.check("/run_code", HOST, b"Bearer bee-tokem", b"", 0.0)
    assert (
        isinstance(wrong, Refusal) and wrong.status == 401 and ("www-authenticate", "Bearer") in wrong.headers
    )
    assert isinstance(access.check("/run_code", HOST, b"Basic acme-token", b"", 0.0), Refusal)


def test_a_refusal_says_whether_a_token_was_presented() -> None:
    """A presented token that matches nothing, in the header or (where allowed) the query
    string, is `unknown_token` (the server reads the registry again for it); no token, or
    another scheme, is not."""
    access = _access(token_in_query=True)
    for authorization, query in [(b"Bearer guess", b""), (None, b"token=guess")]:
        refusal = access.check("/run_code", HOST, authorization, query, 0.0)
        assert isinstance(refusal, Refusal) and refusal.status == 401 and refusal.unknown_token
    for authorization in (None, b"Basic guess"):
        refusal = access.check("/run_code", HOST, authorization, b"", 0.0)
        assert isinstance(refusal, Refusal) and refusal.status == 401 and not refusal.unknown_token


def test_a_rotated_or_removed_token_stops_at_the_next_registry_read() -> None:
    access = _access()
    access.set_tenants({"acme": _hex("old")})
    assert access.check("/run_code", HOST, b"Bearer old", b"", 0.0) == Principal("acme", "acme")
    access.set_tenants({"acme": _hex("new")})
    old = access.check("/run_code", HOST, b"Bearer old", b"", 0.0)
    assert isinstance(old, Refusal) and old.status == 401
    assert access.check("/run_code", HOST, b"Bearer new", b"", 0.0) == Principal("acme", "acme")
    access.set_tenants({})
    assert isinstance(access.check("/run_code", HOST, b"Bearer new", b"", 0.0), Refusal)


def test_without_auth_a_tenants_token_still_names_its_tenant() -> None:
    """http.auth: none (loopback): no token, or one that is no tenant's, acts as default."""
    access = _access(auth="none")
    access.set_tenants({"acme": _hex("acme-token")})
    assert access.check("/run_code", HOST, b"Bearer acme-token", b"", 0.0) == Principal("acme", "acme")
    assert access.check("/run_code", HOST, None, b"", 0.0) == LOOPBACK_CALLER
    assert access.check("/run_code", HOST, b"Bearer other", b"", 0.0) == LOOPBACK_CALLER
    assert LOOPBACK_CALLER.tenant == "default"


def test_the_query_token_names_a_tenant_where_allowed() -> None:
    access = _access(token_in_query=True)
    access.set_tenants({"acme": _hex("acme-token")})
    assert access.check("/run_code", HOST, None, b"token=acme-token", 0.0) == Principal("acme", "acme")


def test_the_rate_limit_is_per_tenant() -> None:
    """acme spending its burst leaves bee's untouched; the Host check is still 403 first."""
    access = _access(rate_limit_per_s=0.01, rate_limit_burst=2)
    access.set_tenants({"acme": _hex("a"), "bee": _hex("b")})
    for _ in range(2):
        assert access.check("/run_code", HOST, b"Bearer a", b"", 0.0) == Principal("acme", "acme")
    limited = access.check("/run_code", HOST, b"Bearer a", b"", 0.0)
    assert isinstance(limited, Refusal) and limited.status == 429
    assert access.check("/run_code", HOST, b"Bearer b", b"", 0.0) == Principal("bee", "bee")
    rebinding = access.check("/run_code", b"evil.example", b"Bearer b", b"", 0.0)
    assert isinstance(rebinding, Refusal) and rebinding.status == 403


def test_admission_refusals_are_429_for_limits_and_503_for_a_full_broker() -> None:
    pytest.importorskip("fastapi")
    from tangram_celery.web.native import admission_status

    assert admission_status("intake full: intake is full (5 actions waiting): ...") == 429
    assert admission_status("intake full: broker full: Redis uses 900 MiB of its 1000 MiB ...") == 503


# ---- the app, per tenant, in front of stand-in clients ------------------------------------------
class Handle:
    def __init__(self, action_id: str) -> None:
        self.id = action_id


class Store:
    """The registry as the default client's store reads it."""

    def __init__(self) -> None:
        self.records: dict[str, TenantRecord] = {}
        self.reads = 0

    async def run(self, call: Any) -> Any:
        assert call.method == "hgetall"
        self.reads += 1
        return dict(self.records)


class Tenant:
    """A stand-in AsyncTangramClient for one tenant: its actions are its own."""

    outstanding = 0

    def __init__(self, tenant: str, store: Store | None = None, refuse: str = "") -> None:
        self.tenant = tenant
        self.store = store or Store()
        self.refuse = refuse
        self.actions: dict[str, ActionResult] = {}
        self.closed = False

    async def languages(self) -> dict[str, list[str]]:
        return {"n0": ["python"]}

    async def submit(self, action: Any) -> Handle:
        if self.refuse:
            raise AdmissionError(self.refuse)
        self.actions[action.id] = ActionResult(
            action_id=action.id, status=ActionStatus.OK, stdout=f"{self.tenant}\n", exit_code=0, units=1
        )
        return Handle(action.id)

    async def result(self, action_id: str, timeout: float | None = 60.0) -> ActionResult:
        return self.actions[action_id]

    async def peek(self, action_id: str) -> tuple[str | None, ActionResult | None]:
        res = self.actions.get(action_id)
        return ("done", res) if res else (None, None)

    async def cancel(self, action_id: str, reason: str = "") -> bool:
        return False

    async def state(self, action_id: str) -> str | None:
        return "done" if action_id in self.actions else None

    async def close(self) -> None:
        self.closed = True


def _server(refuse: dict[str, str] | None = None) -> tuple[Any, dict[str, Tenant], Store]:
    from tangram_celery.client.gate import Gate
    from tangram_celery.web.app import ServerState, create_app
    from tangram_celery.web.tenancy import Tenancy

    refuse = refuse or {}
    cfg = parse_config({"http": {"token": "operator-token", "allowed_hosts": ["t"]}})
    store = Store()
    clients = {"default": Tenant("default", store, refuse.get("default", ""))}
    app = create_app(cfg, "redis://unused", client=clients["default"])  # type: ignore[arg-type]

    def make(name: str) -> Any:
        clients[name] = Tenant(name, refuse=refuse.get(name, ""))
        return clients[name]

    gate = Gate(clients["default"], cfg.http)  # type: ignore[arg-type]
    tenancy = Tenancy(cfg, app.state.access, gate, make)
    app.state.tangram = ServerState(
        cfg=cfg,
        client=clients["default"],  # type: ignore[arg-type]
        gate=gate,
        default_memory_mb=256,
        tenancy=tenancy,
    )
    return app, clients, store


async def _call(app: Any, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any]:
    import httpx

    headers = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.request(method, path, json=body, headers=headers)
        return r.status_code, r.json()


def test_each_token_acts_through_its_tenants_client_and_other_ids_are_404() -> None:
    """acme's and bee's actions run through their own clients; bee asking for acme's id, or
    cancelling it, gets 404; /run_code acts as the token's tenant too; a removed tenant's token
    is 401 after the registry is read again, and its client is closed."""
    pytest.importorskip("fastapi")
    app, clients, store = _server()
    store.records = {
        "acme": TenantRecord(name="acme", token_sha256=_hex("A")),
        "bee": TenantRecord(name="bee", token_sha256=_hex("B")),
    }
    tenancy = app.state.tangram.tenancy

    async def go() -> None:
        await tenancy.refresh()
        body = {"type": "code", "trajectory_id": "t1", "code": "print(1)"}
        status, res = await _call(app, "POST", "/tangram/v1/actions", "A", body)
        assert status == 200 and res["stdout"] == "acme\n", res
        acme_id = res["action_id"]
        assert acme_id in clients["acme"].actions and "bee" not in clients
        assert (await _call(app, "GET", f"/tangram/v1/actions/{acme_id}", "A"))[0] == 200
        status, res = await _call(app, "GET", f"/tangram/v1/actions/{acme_id}", "B")
        assert status == 404 and acme_id not in clients["bee"].actions
        assert (await _call(app, "DELETE", f"/tangram/v1/actions/{acme_id}", "B"))[0] == 404
        assert (await _call(app, "DELETE", f"/tangram/v1/actions/{acme_id}", "A"))[0] == 200
        status, res = await _call(app, "POST", "/run_code", "B", {"code": "print(1)", "language": "python"})
        assert status == 200 and res["run_result"]["stdout"] == "bee\n", res
        status, res = await _call(
            app, "POST", "/run_code", "operator-token", {"code": "x", "language": "python"}
        )
        assert status == 200 and res["run_result"]["stdout"] == "default\n"
        assert (await _call(app, "GET", f"/tangram/v1/actions/{acme_id}", "operator-token"))[0] == 404

        del store.records["bee"]
        await tenancy.refresh()
        assert (await _call(app, "POST", "/run_code", "B", {"code": "x", "language": "python"}))[0] == 401
        assert clients["bee"].closed and "bee" not in tenancy.gates
        assert (await _call(app, "GET", f"/tangram/v1/actions/{acme_id}", "A"))[0] == 200

    asyncio.run(go())


def test_a_tenant_added_since_the_last_read_works_at_its_first_request() -> None:
    """A token that matches nothing has the registry read again before it is refused: a new
    tenant's works at once (not at the next periodic read); tokens that match nothing cost at
    most one read per REREAD_GAP_S, however many are tried."""
    pytest.importorskip("fastapi")
    from tangram_celery.web import tenancy as tenancy_mod

    app, _, store = _server()
    body = {"code": "print(1)", "language": "python"}

    async def go() -> None:
        await app.state.tangram.tenancy.refresh()
        store.records["acme"] = TenantRecord(name="acme", token_sha256=_hex("A"))
        status, res = await _call(app, "POST", "/run_code", "A", body)
        assert status == 200 and res["run_result"]["stdout"] == "acme\n", res
        before = store.reads
        answers = [(await _call(app, "POST", "/run_code", f"guess-{i}", body))[0] for i in range(50)]
        assert answers == [401] * 50
        assert store.reads - before <= 1  # the 50 guesses came well within one REREAD_GAP_S
        assert (await _call(app, "GET", "/v1/ping", ""))[0] == 200  # no token, no read
        assert store.reads - before <= 1

    assert tenancy_mod.REREAD_GAP_S >= 0.5
    asyncio.run(go())


def test_an_intake_refusal_is_429_or_503_for_that_tenant_alone() -> None:
    """acme over its queue limit gets 429, bee on a full broker 503, each with the reason;
    the operator's (default) tenant goes on."""
    pytest.importorskip("fastapi")
    app, _, store = _server(
        refuse={
            "acme": "intake is full (5 actions waiting): retry later",
            "bee": "broker full: Redis uses 950 MiB of its 1000 MiB maxmemory",
        }
    )
    store.records = {
        "acme": TenantRecord(name="acme", token_sha256=_hex("A")),
        "bee": TenantRecord(name="bee", token_sha256=_hex("B")),
    }
    body = {"type": "code", "trajectory_id": "t1", "code": "print(1)"}

    async def go() -> None:
        await app.state.tangram.tenancy.refresh()
        for wait in ("true", "false"):
            status, res = await _call(app, "POST", f"/tangram/v1/actions?wait={wait}", "A", body)
            assert status == 429 and "5 actions waiting" in res["detail"], res
            status, res = await _call(app, "POST", f"/tangram/v1/actions?wait={wait}", "B", body)
            assert status == 503 and "broker full" in res["detail"], res
        assert (await _call(app, "POST", "/tangram/v1/actions", "operator-token", body))[0] == 200

    asyncio.run(go())
