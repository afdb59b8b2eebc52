"""Who may call `tangram serve`, against a live server (issue 37): the Host check that closes
DNS rebinding on loopback, the server-made token, the query-string token only by opt-in, and
the per-token rate limit."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from tests.integration.http_support import http_call, verl_sandbox_utils

pytestmark = pytest.mark.integration

CODE = {"code": "print(int(input()) * 2)", "language": "python", "stdin": "21\n", "run_timeout": 10}


@pytest.mark.deploy(http={"auth": "token", "rate_limit_per_s": 0.02, "rate_limit_burst": 4})
def test_the_default_server_wants_its_own_token_and_refuses_rebinding(http_deployment: Any) -> None:
    """No http.token: the server makes one (0600 in the state dir). A page at evil.example.com
    resolved to 127.0.0.1 (DNS rebinding) gets 403 even with the token; no token: 401; the
    token in the query string: 403 (not opted in); the bearer header: the answer; past the
    burst: 429 with Retry-After."""
    url = http_deployment.http_url
    path = Path(http_deployment.cfg.state_dir) / "http.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    bearer = {"Authorization": f"Bearer {token}"}
    evil = {"Host": "evil.example.com", **bearer}
    status, body, _ = http_call(url, "POST", "/run_code", evil, CODE)
    assert status == 403 and "rebinding" in body["detail"]
    assert http_call(url, "GET", "/v1/ping", {"Host": "evil.example.com:80"})[0] == 403
    assert http_call(url, "GET", "/v1/ping")[0] == 200  # ping needs no token
    status, body, headers = http_call(url, "POST", "/run_code", None, CODE)
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    status, body, _ = http_call(url, "POST", f"/run_code?token={token}", None, CODE)
    assert status == 403 and "token_in_query" in body["detail"] and token not in body["detail"]
    status, body, _ = http_call(url, "POST", "/run_code", {"Host": "localhost", **bearer}, CODE)
    assert status == 200 and body["run_result"]["stdout"] == "42\n", body
    for _ in range(3):  # the rest of the burst of 4
        assert http_call(url, "GET", "/tangram/v1/capabilities", bearer)[0] == 200
    status, body, headers = http_call(url, "GET", "/tangram/v1/capabilities", bearer)
    assert status == 429 and int(headers["retry-after"]) >= 1 and "rate limit" in body["detail"]


@pytest.mark.deploy(http={"token": "it-s3cret-token", "token_in_query": True})
def test_a_query_token_works_where_the_operator_opts_in(http_deployment: Any) -> None:
    """verl's client sends no headers: with http.token_in_query its URL carries the token and
    it scores as usual; a wrong one is 401; the token never reaches the server's log."""
    verl = verl_sandbox_utils()
    base = http_deployment.http_url
    cases = {"inputs": ["3\n"], "outputs": ["6\n"]}
    code = "print(int(input()) * 2)"
    assert verl.check_correctness(base + "/run_code?token=it-s3cret-token", cases, code, timeout=5)[0] == [
        True
    ]
    assert http_call(base, "POST", "/run_code?token=wrong", None, CODE)[0] == 401
    assert http_call(base, "POST", "/run_code", None, CODE)[0] == 401
    logs = Path(http_deployment.cfg.state_dir) / "logs"
    for log in logs.glob("*.log"):
        assert "it-s3cret-token" not in log.read_text(errors="replace"), log
