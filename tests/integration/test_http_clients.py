"""`tangram serve` driven by clients the project did not write: SandboxFusion's own client
package and verl's SandboxFusion client, against a live deployment."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
import requests

from tests.integration.http_support import verl_sandbox_utils

pytestmark = pytest.mark.integration
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
    with pytest.raises(Exception, match="not supported"):
        run(_sf_request(language="go"), endpoint=url, max_attempts=1)


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


@pytest.mark.deploy(**SLACK)
def test_two_hundred_concurrent_calls_all_parse(http_deployment: Any) -> None:
    """240 calls at once from SandboxFusion's client and verl's: every response parses and is
    right (none lost, none an error)."""
    url = http_deployment.http_url
    verl = verl_sandbox_utils()

    def sf_call(i: int) -> bool:
        req = _sf_request(code=f"print({i} * 2)", memory_limit_MB=64, run_timeout=10)
        resp = sandbox_fusion.run_code(req, endpoint=url, max_attempts=1, client_timeout=120)
        return bool(resp.status == "Success" and resp.run_result.stdout == f"{i * 2}\n")

    def verl_call(i: int) -> Any:
        return verl.check_correctness(
            url + "/run_code", {"inputs": [f"{i}\n"], "outputs": [f"{i}\n"]}, "print(input())", 10, 64
        )[0]

    with concurrent.futures.ThreadPoolExecutor(max_workers=240) as pool:
        sf = [pool.submit(sf_call, i) for i in range(120)]
        vr = [pool.submit(verl_call, i) for i in range(120)]
        assert all(f.result() for f in sf)
        assert [f.result() for f in vr] == [[True]] * 120


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
