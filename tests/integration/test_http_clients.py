"""`tangram serve` driven by clients the project did not write: SandboxFusion's own client
package and verl's SandboxFusion client, against a live deployment."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
import requests

from tests.integration.http_support import verl_sandbox_utils

sandbox_fusion = pytest.importorskip("sandbox_fusion")

# pages written, so resident; over the sandbox default (512 MiB): SandboxFusion's client model
# has no memory_limit_MB field, so its requests get the default
MEMORY_HOG = 'x = b"x" * (1024 * 1024 * 1024)\nprint(len(x))'
C_BROKEN = "int main() { return 0;"  # missing brace
C_OK = '#include <stdio.h>\nint main() { int a; scanf("%d", &a); printf("%d\\n", a * 2); return 0; }'
SLACK = {"http": {"slack_s": 60.0, "exec_margin_s": 5.0}}


def _sf_request(**kw: Any) -> Any:
    fields = {"code": "print(1)", "language": "python", "run_timeout": 5, **kw}
    if fields["language"] in sandbox_fusion.models.Language.__args__:
        return sandbox_fusion.RunCodeRequest(**fields)
    # SandboxFusion's model has no plain C; build it unvalidated so its client still sends it
    return sandbox_fusion.RunCodeRequest.construct(
        **{"stdin": None, "files": {}, "fetch_files": [], **fields}
    )


@pytest.mark.deploy(**SLACK)
def test_sandbox_fusion_client_parses_every_outcome(http_deployment: Any) -> None:
    """SandboxFusion's client accepts our responses for a correct run, wrong output, a runtime
    error, a timeout, a memory limit and a C compile error, with their statuses and phases."""
    url = http_deployment.http_url
    run = sandbox_fusion.run_code
    ok = run(_sf_request(code="print(int(input()) * 2)", stdin="21\n"), endpoint=url, max_attempts=1)
    assert (ok.status, ok.run_result.status, ok.run_result.stdout) == ("Success", "Finished", "42\n")
    assert ok.compile_result is None and ok.run_result.return_code == 0
    wrong = run(_sf_request(code="print(41)"), endpoint=url, max_attempts=1)
    assert wrong.status == "Success" and wrong.run_result.stdout != "42\n"
    crash = run(_sf_request(code="raise ValueError('boom')"), endpoint=url, max_attempts=1)
    assert (crash.status, crash.run_result.status, crash.run_result.return_code) == ("Failed", "Finished", 1)
    assert "ValueError" in crash.run_result.stderr
    slow = run(_sf_request(code="while True: pass", run_timeout=1), endpoint=url, max_attempts=1)
    assert (slow.status, slow.run_result.status) == ("Failed", "TimeLimitExceeded")
    hog = run(_sf_request(code=MEMORY_HOG), endpoint=url, max_attempts=1)
    assert (hog.status, hog.run_result.status) == ("Failed", "Finished")
    assert hog.run_result.return_code != 0
    broken = run(_sf_request(code=C_BROKEN, language="c"), endpoint=url, max_attempts=1)
    assert broken.status == "Failed" and broken.run_result is None
    assert broken.compile_result.return_code != 0 and "error" in broken.compile_result.stderr
    mapping = sandbox_fusion.SummaryMapping(CompileFailed="CE", RunTimeout="TLE", RunFailed="RE")
    summary = sandbox_fusion.summary_run_code_result
    assert [summary(r, mapping) for r in (ok, crash, slow, broken)] == ["Success", "RE", "TLE", "CE"]
    c_ok = run(_sf_request(code=C_OK, language="c", stdin="4\n"), endpoint=url, max_attempts=1)
    assert (
        c_ok.status == "Success" and c_ok.compile_result.return_code == 0 and c_ok.run_result.stdout == "8\n"
    )
    # the exact Tangram status rides along in a key SandboxFusion's model ignores
    raw = requests.post(
        url + "/run_code", json={"code": MEMORY_HOG, "language": "python", "memory_limit_MB": 64}
    )
    assert raw.json()["tangram"]["status"] == "memory_limit"
    with pytest.raises(Exception, match="400"):  # a language Tangram does not run: refused, 400
        run(_sf_request(language="lean"), endpoint=url, max_attempts=1)


@pytest.mark.deploy(**SLACK)
def test_verl_client_scores_every_outcome(http_deployment: Any) -> None:
    """verl's check_correctness, pointed at /run_code, classifies our answers as it classifies
    SandboxFusion's: correct True, wrong False, runtime error -2, timeout -3, compile error -4."""
    verl = verl_sandbox_utils()
    url = http_deployment.http_url + "/run_code"
    cases = {"inputs": ["3\n", "5\n"], "outputs": ["6\n", "10\n"]}
    check = verl.check_correctness
    assert check(url, cases, "print(int(input()) * 2)", timeout=5)[0] == [True, True]
    assert check(url, cases, "print(int(input()) * 3)", timeout=5)[0] == [False, False]
    assert check(url, cases, "raise SystemExit(2)", timeout=5)[0] == [-2, -2]
    assert check(url, cases, "while True: pass", timeout=1)[0] == [-3, -3]
    results, meta = check(url, cases, MEMORY_HOG, timeout=5, memory_limit_mb=64)
    assert results == [-2, -2] and meta[0]["api_status"] == "Failed"
    # verl's list of languages has no plain C: add it so that its parser sees our C answers
    if "c" not in verl.SUPPORTED_LANGUAGES:
        verl.SUPPORTED_LANGUAGES.append("c")
    assert check(url, cases, C_BROKEN, timeout=5, language="c")[0] == [-4, -4]
    assert check(url, cases, C_OK, timeout=5, language="c")[0] == [True, True]


# Default deadlines (slack 8 s, under the 10 s verl's client adds to compile + run), so that an
# overloaded server answers 504 before verl's own read timeout; small sandboxes, so that many
# run at once (SandboxFusion's client cannot send memory_limit_MB: it gets the default).
@pytest.mark.deploy(sandbox={"backend": "auto", "default_timeout_s": 10, "default_memory_mb": 64})
def test_two_hundred_concurrent_calls_all_parse(http_deployment: Any) -> None:
    """240 calls at once from SandboxFusion's client and verl's: every answer parses and is
    either right or, where this machine cannot start the call in time, the documented 504
    (which verl retries); never a read timeout, a parse failure or another error."""
    url = http_deployment.http_url
    verl = verl_sandbox_utils()

    def sf_call(i: int) -> str:
        req = _sf_request(code=f"print({i} * 2)", run_timeout=10)
        try:
            resp = sandbox_fusion.run_code(req, endpoint=url, max_attempts=1, client_timeout=120)
        except Exception as e:  # its client raises on any non-200
            if "responded with code 504" in str(e):
                return "504"
            return "late" if "had no result" in str(e) else f"error: {e}"
        ok = resp.status == "Success" and resp.run_result.stdout == f"{i * 2}\n"
        return "ok" if ok else f"wrong: {resp}"

    def verl_call(i: int) -> str:
        results, meta = verl.check_correctness(
            url + "/run_code", {"inputs": [f"{i}\n"], "outputs": [f"{i}\n"]}, "print(input())", 10, 64
        )
        if results == [True]:
            return "ok"
        why = str(meta[0].get("api_request_error") or "")
        if results == [-1] and "Gateway Timeout (504)" in why:
            return "504"
        response = meta[0].get("api_response") or {}
        if results == [-1] and (response.get("tangram") or {}).get("status") == "deadline":
            return "late"
        return f"error: {results} {why}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=240) as pool:
        answers = [pool.submit(sf_call, i) for i in range(120)] + [
            pool.submit(verl_call, i) for i in range(120)
        ]
        outcomes = [f.result() for f in answers]
    # "late": the documented answer for an action that started but overran its limits by more
    # than http.exec_margin_s (a sandbox start slowed down by a machine at load 20)
    assert set(outcomes) <= {"ok", "504", "late"}, [o for o in outcomes if o not in ("ok", "504", "late")][:5]
    assert outcomes.count("ok") > 0


@pytest.mark.deploy(**SLACK)
def test_files_in_and_fetch_files_out(http_deployment: Any) -> None:
    """Binary files go in base64 and come back through fetch_files (SandboxFusion's client
    parses them); a symlink out of the sandbox, a missing file and a root-owned file are left
    out, and a path escaping the workdir is refused."""
    import base64

    url = http_deployment.http_url
    code = (
        "import os\n"
        "data = open('in/data.bin', 'rb').read()\n"
        "open('out.bin', 'wb').write(bytes(reversed(data)))\n"
        "open('/tmp/t.txt', 'w').write('tmp')\n"
        "os.symlink('/proc/1/environ', 'leak')\n"
    )
    req = _sf_request(
        code=code,
        files={"in/data.bin": base64.b64encode(b"\x00\x01\xfe\xff").decode()},
        fetch_files=["out.bin", "/tmp/t.txt", "leak", "missing.txt", "main.py"],
    )
    resp = sandbox_fusion.run_code(req, endpoint=url, max_attempts=1)
    assert resp.status == "Success", resp
    assert base64.b64decode(resp.files["out.bin"]) == b"\xff\xfe\x01\x00"
    assert base64.b64decode(resp.files["/tmp/t.txt"]) == b"tmp"
    assert "leak" not in resp.files and "missing.txt" not in resp.files
    bad = requests.post(
        url + "/run_code",
        json={"code": "print(1)", "language": "python", "fetch_files": ["../../etc/passwd"]},
    ).json()
    assert bad["status"] == "SandboxError" and "fetch_files" in bad["message"]
