"""The HTTP front door (`tangram serve`), side by side in one run on one local deployment:

A. round trip of a trivial program (`print(1)`), one call in flight: `/run_code` vs the Python
   client for the same action, in a warm trajectory and as a one-shot action; over HTTP both
   with `requests` (verl's client) and with a lean keep-alive `http.client` connection. Target:
   HTTP p50 (`requests`) at most 3 ms above the Python client's.
B. 1,000 concurrent one-shot `/run_code` calls, each the request verl sends (compile and run
   timeout 10 s, 1024 MiB): every call answered, nothing but 200 or the documented 504, and
   every 504'd action provably not executed (cancelled in the store, never claimed by a worker,
   absent from the run log). Then the same with verl's retries (a 504 retried after 1 s, 2 s).
C. verl's own SandboxFusion `compute_score` over the 164 HumanEval problems converted to
   stdin/stdout cases (verl's `fn_name` form: one JSON argument per stdin line), through
   `/run_code` (one request per case); beside it Tangram's verl adapter (one action per problem)
   and a plain unsandboxed subprocess harness. Every reference must score 1.0.

Run: .venv/bin/python benchmarks/http_api.py [--calls 1000] [--round-trips 300]
Writes benchmarks/results/http.json and http.png.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Not named http.py: every script in this directory has it first on sys.path, and a file of that
# name shadowed the standard library's `http` package for all of them (urllib, prometheus_client).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import ast
import asyncio
import importlib.util
import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.common import RESULTS, percentile, write_json
from tangram_celery.client.sync import TangramClient
from tangram_celery.common.actions import CodeAction
from tangram_celery.common.config import load_config
from tangram_celery.deploy import Deployment
from tangram_celery.store import Store, akey
from tests.fixtures.redis import deployment_config
from tests.integration.http_support import run_log
from tests.problems import humaneval_rows

PY = "/usr/bin/python3"


def load_verl_sandbox_fusion() -> Any:
    """verl's `reward_score/sandbox_fusion` package (compute_score + its client), by path."""
    spec = importlib.util.find_spec("verl")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps verl==0.9.1"
    pkg = Path(spec.submodule_search_locations[0]) / "utils/reward_score/sandbox_fusion"
    mspec = importlib.util.spec_from_file_location(
        "verl_sandbox_fusion", pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    assert mspec is not None and mspec.loader is not None
    module = importlib.util.module_from_spec(mspec)
    sys.modules["verl_sandbox_fusion"] = module
    logging.getLogger("verl_sandbox_fusion").setLevel(logging.CRITICAL)  # one line per retried case
    mspec.loader.exec_module(module)
    return module


# ---- A: round trips ------------------------------------------------------------------------------
def round_trips(dep: Deployment, n: int) -> dict[str, Any]:
    """Per mode, n rounds of three calls of the same action, in a rotating order: the Python
    client, `/run_code` through `requests` (verl's HTTP client; it re-reads the environment's
    proxy settings on every call, a client-side cost that grows with the environment) and through
    a lean keep-alive `http.client` connection (the server hop alone)."""
    import http.client

    import requests

    client = TangramClient(dep.url)
    session = requests.Session()
    url = dep.http_url + "/run_code"
    lean = http.client.HTTPConnection(*dep.http_url.removeprefix("http://").rsplit(":", 1))
    kinds = ("python", "http", "http_lean")
    out: dict[str, dict[str, list[float]]] = {
        "warm": {k: [] for k in kinds},
        "one_shot": {k: [] for k in kinds},
    }
    for mode in ("warm", "one_shot"):
        for i in range(n + 5):  # the first 5 of each mode warm up
            body: dict[str, Any] = {"code": "print(1)", "language": "python"}
            if mode == "warm":
                body["trajectory_id"] = "bench-warm-http"
            raw = json.dumps(body)

            def python_call(mode: str = mode) -> tuple[float, str]:
                # the same action: in a warm trajectory, or one-shot (no trajectory), as the server
                # submits it
                action = (
                    CodeAction(trajectory_id="bench-warm", code="print(1)")
                    if mode == "warm"
                    else CodeAction(code="print(1)")
                )
                t0 = time.perf_counter()
                res = client.submit(action).result(timeout=60)
                return time.perf_counter() - t0, res.stdout

            def http_call(body: dict[str, Any] = body) -> tuple[float, str]:
                t0 = time.perf_counter()
                r = session.post(url, json=body)
                took = time.perf_counter() - t0
                return took, r.json()["run_result"]["stdout"]

            def lean_call(raw: str = raw) -> tuple[float, str]:
                t0 = time.perf_counter()
                lean.request("POST", "/run_code", raw, {"Content-Type": "application/json"})
                answer = lean.getresponse().read()
                took = time.perf_counter() - t0
                return took, json.loads(answer)["run_result"]["stdout"]

            calls = {"python": python_call, "http": http_call, "http_lean": lean_call}
            took: dict[str, float] = {}
            for k in kinds[i % 3 :] + kinds[: i % 3]:  # rotate: none always first or last
                took[k], stdout = calls[k]()
                assert stdout == "1\n", (k, stdout)
            if i >= 5:
                for k in kinds:
                    out[mode][k].append(took[k])
    client.close()
    lean.close()
    summary: dict[str, Any] = {}
    for mode, d in out.items():
        row: dict[str, Any] = {"n": n, "python_p50_ms": round(percentile(d["python"], 0.5) * 1e3, 2)}
        for k, tag in (("http", ""), ("http_lean", "_lean")):
            p50_py, p50_http = percentile(d["python"], 0.5), percentile(d[k], 0.5)
            row[f"http{tag}_p50_ms"] = round(p50_http * 1e3, 2)
            row[f"added{tag}_p50_ms"] = round((p50_http - p50_py) * 1e3, 2) + 0.0  # no -0.0
            # per call pair (run back to back): less exposed to the machine's load drifting
            row[f"added{tag}_paired_p50_ms"] = (
                round(percentile([h - q for h, q in zip(d[k], d["python"], strict=True)], 0.5) * 1e3, 2) + 0.0
            )
            row[f"http{tag}_p90_ms"] = round(percentile(d[k], 0.9) * 1e3, 2)
        row["python_p90_ms"] = round(percentile(d["python"], 0.9) * 1e3, 2)
        summary[mode] = row
    return summary


# ---- B: concurrency ------------------------------------------------------------------------------
# What verl's SandboxFusion client sends for one test case (reward.sandbox_fusion defaults:
# compile and run timeout 10 s each, memory_limit_mb 1024); it waits compile + run + 10 s.
VERL_REQUEST = {
    "compile_timeout": 10,
    "run_timeout": 10,
    "memory_limit_MB": 1024,
    "files": {},
    "fetch_files": [],
}
VERL_RETRY_DELAYS_S = (1.0, 2.0)  # verl retries a 504 twice, after 1 s then 2 s


def concurrent_calls(dep: Deployment, calls: int, verl_retries: bool = False) -> dict[str, Any]:
    """`calls` one-shot `/run_code` requests at once, each as verl sends it; with `verl_retries`,
    a 504 is retried as verl's client does. Every 504'd attempt is checked: cancelled in the
    store, never claimed by a worker, absent from the run log."""
    import aiohttp

    url = dep.http_url + "/run_code"
    delays = VERL_RETRY_DELAYS_S if verl_retries else ()
    refused_ids: list[str] = []
    refused_before_enqueue = 0

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, dict[str, Any], float, int]:
        nonlocal refused_before_enqueue
        t0 = time.monotonic()
        body = {"code": f"print({i})", "language": "python", "stdin": "", **VERL_REQUEST}
        for attempt, delay in enumerate((*delays, None), 1):
            async with session.post(url, json=body) as resp:
                status, answer = resp.status, await resp.json(content_type=None)
            if status != 504 or delay is None:
                return status, answer, time.monotonic() - t0, attempt
            if answer["tangram"]["action_id"]:
                refused_ids.append(answer["tangram"]["action_id"])
            else:
                refused_before_enqueue += 1
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def go() -> list[Any]:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
            return list(await asyncio.gather(*(one(s, i) for i in range(calls)), return_exceptions=True))

    t0 = time.monotonic()
    answers = asyncio.run(go())
    wall_s = time.monotonic() - t0
    errors = [repr(a) for a in answers if isinstance(a, BaseException)]
    ok = [(i, a) for i, a in enumerate(answers) if not isinstance(a, BaseException) and a[0] == 200]
    refused = [a for a in answers if not isinstance(a, BaseException) and a[0] == 504]
    other = [a[0] for a in answers if not isinstance(a, BaseException) and a[0] not in (200, 504)]
    sandbox_errors = [a[1]["tangram"] for _, a in ok if a[1]["status"] != "Success"]
    wrong = [i for i, a in ok if a[1]["status"] == "Success" and a[1]["run_result"]["stdout"] != f"{i}\n"]
    ran_ids = {a[1]["tangram"]["action_id"] for _, a in ok if a[1]["status"] == "Success"}
    cancelled = refused_ids + [a[1]["tangram"]["action_id"] for a in refused if a[1]["tangram"]["action_id"]]
    refused_before_enqueue += sum(1 for a in refused if not a[1]["tangram"]["action_id"])
    store = Store(dep.url)
    states = store.states(cancelled)
    claimed = [a for a in cancelled if store.r.hget(akey(a), "worker") is not None]
    log = run_log(Path(dep.cfg.state_dir), wait_for=ran_ids, timeout_s=60)
    ran_answer_s = sorted(a[2] for _, a in ok)
    return {
        "calls": calls,
        "request": VERL_REQUEST,
        "verl_retries": verl_retries,
        "wall_s": round(wall_s, 2),
        "answered": len(answers) - len(errors),
        "client_errors": errors[:5],
        "status_200": len(ok),
        "status_504": len(refused),
        "other_status": other,
        "wrong_output": len(wrong),
        "status_200_not_success": len(sandbox_errors),
        "not_success_statuses": sorted({e["status"] for e in sandbox_errors}),
        "not_success_examples": [e["error"][:200] for e in sandbox_errors[:3]],
        "answered_200_after_attempts": {
            str(n): sum(1 for _, a in ok if a[3] == n) for n in range(1, len(delays) + 2)
        },
        "refused_before_enqueue": refused_before_enqueue,
        "refused_cancelled": len(cancelled),
        "cancelled_state_ok": states == ["cancelled"] * len(cancelled),
        "cancelled_claimed_by_a_worker": len(claimed),
        "cancelled_in_run_log": len(set(cancelled) & set(log)),
        "ran_in_run_log": len(ran_ids & set(log)),
        "ran_answer_p50_s": round(ran_answer_s[len(ran_answer_s) // 2], 2) if ran_answer_s else None,
        "last_200_answer_s": round(ran_answer_s[-1], 2) if ran_answer_s else None,
        "max_answer_s": round(max(a[2] for a in answers if not isinstance(a, BaseException)), 2),
    }


# ---- C: HumanEval through verl's compute_score ---------------------------------------------------
def _show(v: Any) -> str:
    """How verl's fn_name wrapper prints a result."""
    if isinstance(v, dict | list | tuple | bool) or v is None:
        return json.dumps(v)
    return str(v)


def _case(node: ast.Assert) -> tuple[list[Any], Any] | None:
    """(arguments, expected) of an assert that pins one call's result to a literal:
    `candidate(...) == X`, `candidate(...) is True/False`, `tuple(candidate(...)) == tuple(X)`,
    and bare `assert candidate(...)` / `assert not candidate(...)`; None for anything else."""
    test = node.test
    expected: Any
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        call, expected = test.operand, False
    elif isinstance(test, ast.Call):
        call, expected = test, True
    elif isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq | ast.Is):
        call, rhs = test.left, test.comparators[0]
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "tuple":
            if len(call.args) != 1 or not isinstance(rhs, ast.Call) or len(rhs.args) != 1:
                return None
            call, rhs = call.args[0], rhs.args[0]  # tuple(candidate(x)) == tuple([...])
        try:
            expected = ast.literal_eval(rhs)
        except (ValueError, TypeError, SyntaxError):
            return None
        if isinstance(test.ops[0], ast.Is) and not isinstance(expected, bool):
            return None
    else:
        return None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "candidate"):
        return None
    if call.keywords or not call.args:
        return None
    try:
        return [ast.literal_eval(a) for a in call.args], expected
    except (ValueError, TypeError, SyntaxError):
        return None


def humaneval_stdio() -> list[dict[str, Any]]:
    """HumanEval as stdin/stdout cases in verl's `fn_name` form (the arguments one JSON value per
    stdin line, the printed result compared): every assert that pins a call's result to a
    literal becomes a case. Problems whose tests are tolerances or round trips through other
    functions (e.g. `abs(candidate(x) - y) < 1e-6`) have no such assert and are left out."""
    problems = []
    for row in humaneval_rows():
        inputs, outputs = [], []
        for node in ast.walk(ast.parse(row["test"])):
            case = _case(node) if isinstance(node, ast.Assert) else None
            if case is None:
                continue
            args, expected = case
            try:
                line_args = [json.dumps(a) for a in args]
                shown = _show(expected)
            except (TypeError, ValueError):
                continue  # not JSON (sets, ...)
            if any("\n" in a for a in line_args):
                continue
            inputs.append("\n".join(line_args))
            outputs.append(shown)
        if inputs:
            problems.append(
                {
                    "task_id": row["task_id"],
                    "solution": row["prompt"] + row["canonical_solution"],
                    "tests": {"inputs": inputs, "outputs": outputs, "fn_name": row["entry_point"]},
                }
            )
    return problems


def plain_harness(problems: list[dict[str, Any]], workers: int = 2) -> tuple[float, int]:
    """Each case in a fresh unsandboxed `python3` (Tangram's fn_name harness), 2 at a time."""
    from tangram_celery.integrations.code_tests import to_test_cases

    jobs = []
    for p in problems:
        code, cases = to_test_cases(p["solution"], p["tests"])
        jobs += [(code, c.stdin or "", c.expected_stdout or "") for c in cases]

    def run(job: tuple[str, str, str]) -> bool:
        code, stdin, expected = job
        with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
            f.write(code)
            f.flush()
            out = subprocess.run([PY, f.name], input=stdin, capture_output=True, text=True, timeout=10)
        return out.stdout.rstrip("\n") == expected.rstrip("\n")

    t0 = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        passed = sum(pool.map(run, jobs))
    return time.monotonic() - t0, passed


def humaneval(dep: Deployment, concurrency: int, max_concurrent: int) -> dict[str, Any]:
    verl_sf = load_verl_sandbox_fusion()
    from tangram_celery.integrations.verl import compute_score_sync

    problems = humaneval_stdio()
    n_cases = sum(len(p["tests"]["inputs"]) for p in problems)
    completions = [f"```python\n{p['solution']}\n```" for p in problems]
    url = dep.http_url + "/run_code"

    import threading

    # verl's reward.sandbox_fusion.max_concurrent: requests in flight, over all problems
    semaphore = threading.Semaphore(max_concurrent)

    def verl_score(i: int) -> float:
        score, _ = verl_sf.compute_score(
            url, semaphore, 1024, completions[i], problems[i]["tests"], timeout=10
        )
        return float(score)

    def tangram_score(i: int) -> float:
        return float(
            compute_score_sync(
                "humaneval", completions[i], problems[i]["tests"], tangram_url=dep.http_url, cpus="1..2"
            )["score"]
        )

    out: dict[str, Any] = {
        "problems": len(problems),
        "humaneval_problems": 164,
        "cases": n_cases,
        "problem_concurrency": concurrency,
        "verl_max_concurrent": max_concurrent,
    }
    for name, fn in (("verl_run_code", verl_score), ("tangram_adapter", tangram_score)):
        t0 = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            scores = list(pool.map(fn, range(len(problems))))
        wall = time.monotonic() - t0
        bad = [problems[i]["task_id"] for i, s in enumerate(scores) if s != 1.0]
        out[name] = {
            "wall_s": round(wall, 2),
            "cases_per_s": round(n_cases / wall, 1),
            "all_correct": not bad,
            "not_correct": bad[:10],
        }
    wall, passed = plain_harness(problems)
    out["plain_harness"] = {
        "wall_s": round(wall, 2),
        "cases_per_s": round(n_cases / wall, 1),
        "all_correct": passed == n_cases,
    }
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    rt = data["round_trip"]
    modes = list(rt)
    xs = range(len(modes))
    axes[0].bar([x - 0.2 for x in xs], [rt[m]["python_p50_ms"] for m in modes], 0.4, label="Python client")
    axes[0].bar([x + 0.2 for x in xs], [rt[m]["http_p50_ms"] for m in modes], 0.4, label="/run_code")
    axes[0].set_xticks(list(xs), modes)
    axes[0].set_ylabel("p50 round trip, ms")
    axes[0].set_title("print(1), one in flight")
    axes[0].legend()
    c = data["concurrency"]
    runs = [("no retry", c)]
    if "concurrency_verl_retries" in data:
        runs.append(("verl's retries", data["concurrency_verl_retries"]))
    for k, (label, run) in enumerate(runs):
        xs2 = [x + 0.4 * k - 0.2 * (len(runs) - 1) for x in range(3)]
        counts = [run["status_200"], run["status_504"], len(run["other_status"])]
        axes[1].bar(xs2, counts, 0.4, label=f"{label}: {run['wall_s']} s")
    axes[1].set_xticks(range(3), ["200", "504 (not run)", "other"])
    axes[1].legend()
    axes[1].set_title(f"{c['calls']} concurrent /run_code, as verl sends them")
    h = data["humaneval"]
    names = ["verl_run_code", "tangram_adapter", "plain_harness"]
    axes[2].bar(
        ["verl via /run_code", "Tangram adapter", "plain harness"], [h[n]["cases_per_s"] for n in names]
    )
    axes[2].set_ylabel("test cases / s")
    axes[2].set_title(f"HumanEval stdio ({h['problems']} problems, {h['cases']} cases)")
    fig.suptitle(f"tangram serve on {os.cpu_count()} cores, load {data['load_avg_1m']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--round-trips", type=int, default=300, help="rounds per mode (3 calls each)")
    ap.add_argument("--problem-concurrency", type=int, default=8, help="problems scored at once")
    ap.add_argument(
        "--verl-max-concurrent", type=int, default=8, help="verl's reward.sandbox_fusion.max_concurrent"
    )
    ap.add_argument("--skip-humaneval", action="store_true")
    ap.add_argument("--skip-round-trips", action="store_true")
    ap.add_argument("--skip-verl-retries", action="store_true", help="B without the run that retries 504s")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tangram-bench-http-"))
    path = deployment_config(tmp, sandbox={"backend": "auto", "default_timeout_s": 10})
    dep = Deployment(load_config(path), path, with_flower=False)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below
    try:
        dep.start(progress=False)
        data: dict[str, Any] = {"load_avg_1m": round(os.getloadavg()[0], 2), "cores": os.cpu_count()}
        if not args.skip_round_trips:
            data["round_trip"] = round_trips(dep, args.round_trips)
            print(json.dumps(data["round_trip"], indent=1), flush=True)
        data["concurrency"] = concurrent_calls(dep, args.calls)
        print(json.dumps(data["concurrency"], indent=1), flush=True)
        if not args.skip_verl_retries:
            data["concurrency_verl_retries"] = concurrent_calls(dep, args.calls, verl_retries=True)
            print(json.dumps(data["concurrency_verl_retries"], indent=1), flush=True)
        if not args.skip_humaneval:
            data["humaneval"] = humaneval(dep, args.problem_concurrency, args.verl_max_concurrent)
            print(json.dumps(data["humaneval"], indent=1), flush=True)
        data["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    finally:
        dep.stop()
    out = write_json("http", data)
    if "humaneval" in data and "round_trip" in data:
        plot(data, RESULTS / "http.png")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
