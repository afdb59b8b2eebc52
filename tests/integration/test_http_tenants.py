"""Two tenants on one live deployment over HTTP (issue 37): each token acts as its tenant
through /run_code (verl's own client too, the token in its URL) and the native API; the same
trajectory name is two sandboxes; the other
tenant's action id is 404 (never 403); a rotated token is 401 within the registry's refresh;
403 stays the Host check's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tangram_celery.cli import main
from tests.fixtures.common import wait_until
from tests.integration.http_support import bearer_call, verl_sandbox_utils

pytestmark = pytest.mark.integration


def _tenant(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["tenant", *argv, "--json"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


@pytest.mark.deploy(http={"token": "operator-s3cret", "token_in_query": True})
def test_two_tenants_act_apart_over_http(http_deployment: Any, capsys: pytest.CaptureFixture[str]) -> None:
    url = http_deployment.http_url
    admin = ["--broker-url", http_deployment.url]
    a = _tenant(capsys, "add", "acme", *admin)["http_token"]
    b = _tenant(capsys, "add", "bee", *admin)["http_token"]
    # a new tenant's token counts at its first request (the server reads the registry for it)
    assert bearer_call(url, "GET", "/tangram/v1/capabilities", b)[0] == 200
    assert bearer_call(url, "GET", "/tangram/v1/capabilities", a)[0] == 200

    # verl's own SandboxFusion client, acme's token in its URL (it sends no headers): acme's work
    verl = verl_sandbox_utils()
    code, cases = "print(int(input()) * 2)", {"inputs": ["3\n"], "outputs": ["6\n"]}
    passed, meta = verl.check_correctness(f"{url}/run_code?token={a}", cases, code, timeout=5)
    assert passed == [True], meta
    verl_id = meta[0]["api_response"]["tangram"]["action_id"]
    assert bearer_call(url, "GET", f"/tangram/v1/actions/{verl_id}", a)[0] == 200
    assert bearer_call(url, "GET", f"/tangram/v1/actions/{verl_id}", b)[0] == 404

    # /run_code as acme, in its trajectory t1: a file there
    write = {"code": "open('f', 'w').write('acme'); print('ok')", "language": "python", "trajectory_id": "t1"}
    status, res = bearer_call(url, "POST", "/run_code", a, write)
    assert status == 200 and res["run_result"]["stdout"] == "ok\n", res
    acme_id = res["tangram"]["action_id"]

    # the native API as bee, in ITS trajectory t1: acme's file is not there
    read = {"type": "code", "trajectory_id": "t1", "code": "import os; print(os.path.exists('f'))"}
    status, res = bearer_call(url, "POST", "/tangram/v1/actions", b, read)
    assert status == 200 and res["stdout"] == "False\n", res
    bee_id = res["action_id"]
    assert res["trajectory_id"] == "t1"  # the caller's own ids come back

    # each reads its own; the other's id is 404, for reading, waiting and cancelling alike
    assert bearer_call(url, "GET", f"/tangram/v1/actions/{bee_id}", b)[0] == 200
    assert bearer_call(url, "GET", f"/tangram/v1/actions/{acme_id}", a)[0] == 200
    for path in (f"/tangram/v1/actions/{acme_id}", f"/tangram/v1/actions/{acme_id}?wait_s=1"):
        assert bearer_call(url, "GET", path, b)[0] == 404
    assert bearer_call(url, "DELETE", f"/tangram/v1/actions/{acme_id}", b)[0] == 404
    assert bearer_call(url, "GET", f"/tangram/v1/actions/{bee_id}", "operator-s3cret")[0] == 404
    assert bearer_call(url, "GET", f"/tangram/v1/actions/{bee_id}", a, Host="evil.example.com")[0] == 403
    status, _ = bearer_call(url, "GET", f"/tangram/v1/actions/{bee_id}", "nope")
    assert status == 401
    for tid in ("t1",):
        assert bearer_call(url, "POST", f"/tangram/v1/trajectories/{tid}/close", a)[0] == 202

    # a rotated token: 401 from the next registry read; the new one acts as bee
    new_b = _tenant(capsys, "rotate", "bee", "--token-only", *admin)["http_token"]
    wait_until(
        "the old token is refused",
        lambda: bearer_call(url, "GET", "/tangram/v1/capabilities", b)[0] == 401,
        10.0,
    )
    assert bearer_call(url, "GET", f"/tangram/v1/actions/{bee_id}", new_b)[0] == 200
    # a removed tenant: 401 too
    capsys.readouterr()
    assert main(["tenant", "remove", "acme", "--force", *admin]) == 0
    wait_until(
        "a removed tenant is refused",
        lambda: bearer_call(url, "GET", "/tangram/v1/capabilities", a)[0] == 401,
        10.0,
    )
