"""Compiled languages through `tangram serve` with verl's own SandboxFusion client, and a language
the deployment does not offer refused at submit (HTTP 400 and the Python client), never queued."""

from __future__ import annotations

from typing import Any

import pytest
import requests

from tests.integration.http_support import verl_sandbox_utils
from tests.problems.languages import FAILING, language_problems

# rust left out on purpose: the deployment offers every other language
OFFERED = ["python", "bash", "c", "cpp", "nodejs", "go", "java"]
CASES = {"inputs": ["3\n1 2 3\n", "1\n-7\n"], "outputs": ["6\n", "-7\n"]}


@pytest.mark.deploy(
    sandbox={"backend": "auto", "default_timeout_s": 10, "languages": OFFERED},
    http={"slack_s": 60.0, "exec_margin_s": 5.0},
)
def test_verl_scores_cpp_and_java_and_an_unoffered_language_is_refused(
    http_deployment: Any, toolchains: list[str]
) -> None:
    """verl's check_correctness over /run_code: C++ and Java references pass, broken ones fail,
    compile errors are -4; rust, not offered here, is refused with 400 and by the client."""
    from tangram_celery import TangramClient
    from tangram_celery.common.actions import CodeAction
    from tangram_celery.common.errors import ActionRejected

    verl = verl_sandbox_utils()
    url = http_deployment.http_url + "/run_code"
    check = verl.check_correctness
    for lang in ("cpp", "java"):
        p = next(p for p in language_problems() if p.name == f"{lang}_sum")
        assert check(url, CASES, p.reference, timeout=20, language=lang)[0] == [True, True], lang
        assert check(url, CASES, p.broken, timeout=20, language=lang)[0] == [False, False], lang
        broken = FAILING[lang]["compile_error"]
        results, meta = check(url, CASES, broken, timeout=20, language=lang)
        assert results == [-4, -4] and meta[0]["status"] == "compile_error", lang

    caps = requests.get(http_deployment.http_url + "/v1/capabilities").json()
    assert caps["languages_reported"] and caps["languages"] == OFFERED
    assert caps["languages_by_node"] == {"n0": OFFERED}
    assert set(caps["compiled_languages"]) == {"c", "cpp", "go", "java"}

    refused = requests.post(url, json={"code": "fn main(){}", "language": "rust"})
    assert refused.status_code == 400
    body = refused.json()
    assert body["status"] == "SandboxError" and "'rust' is not available" in body["message"]
    unknown = requests.post(url, json={"code": "x", "language": "cobol"})
    assert unknown.status_code == 400 and "not supported" in unknown.json()["message"]
    native = requests.post(
        http_deployment.http_url + "/tangram/v1/run_tests",
        json={"code": "fn main(){}", "language": "rust", "cases": [{"stdin": "", "expected_stdout": ""}]},
    )
    assert native.status_code == 400 and "not available" in native.json()["detail"]

    client = TangramClient(http_deployment.url)
    with pytest.raises(ActionRejected, match="'rust' is not available"):
        client.submit(CodeAction(language="rust", code="fn main(){}"))
    assert client.store.queued_count() == 0  # nothing was enqueued
