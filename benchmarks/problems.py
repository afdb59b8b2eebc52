"""Correctness-suite throughput on 2 cores, per language: what the sandbox costs, against fair
baselines.

The same problems (164 HumanEval problems in Python, plus problems in C, bash, C++, Node.js,
Go, Java and Rust; reference solutions, every test), 2 workers (one per core), each language
measured on its own, every variant side by side in one run:
- plain: a subprocess harness of one's own, unsandboxed: per test a fresh process
  (`python3 main.py`, `node main.js`, the binary, `java Main`), each compiled program built once
  per problem with the runner's own compile command. Not the same runner: this is what a
  cold-start harness costs a user.
- bare: Tangram's runner unsandboxed (benchmarks/bare_runner.py): the same warm fork server and
  harness, no cgroups, no isolation. Against `namespace`: the cost of isolation, same runner.
- namespace: the namespace backend (the runner in the sandbox).
- namespace_fresh: the namespace backend with a fresh interpreter per test (Python only: each
  test runs `python3` from bash; every other language already starts a fresh process per test
  in all variants). Against `plain`: the cost of isolation, same cold start.
- docker: the Docker backend (the runner in a container).
Variants are interleaved: per language, each round runs every variant in turn, so that all see
the same load (the machine is shared; the load average is recorded at start and end).
A compiled program is built once per problem everywhere (each round uses fresh sandboxes and
runners, started before the clock, so the build cache never carries over between rounds and no
start-up is timed). Every result must pass.

Run: .venv/bin/python benchmarks/problems.py [--rounds 3] [--no-docker]
Writes benchmarks/results/problems.json and problems.png.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bare_runner import BareRunner
from benchmarks.common import RESULTS, write_json
from benchmarks.sandbox import engine
from tangram_celery.common.actions import LANGUAGES, TestCase
from tangram_celery.common.config import SandboxConfig
from tangram_celery.sandbox import ExecRequest, open_sandbox
from tangram_celery.sandbox.languages import detect
from tangram_runner import langs
from tests.problems import Problem, all_problems

TIMEOUT_S = 10.0
COMPILE_S = 60.0  # generous: a loaded shared machine; the compile is timed, not limited
PASS = "__tangram_pass__"
LABELS = {
    "plain": "subprocess harness, fresh process per test (what a cold-start harness costs a user)",
    "bare": "Tangram's runner unsandboxed (warm fork server, no namespaces or cgroups)",
    "namespace": "sandbox, namespace backend (warm fork server)",
    "namespace_fresh": "sandbox, namespace backend, fresh interpreter per test",
    "docker": "sandbox, Docker backend (warm fork server)",
}
Solve = Callable[[int, int, list[Problem]], list[bool]]  # (core, round, problems) -> passed
Prepare = Callable[[int, int], None]  # (core, round): start what the round runs in, untimed


def _norm(s: str) -> str:
    return "\n".join(x.rstrip() for x in s.strip().splitlines())


def plain_solve(p: Problem) -> bool:
    """One problem with plain subprocesses, unsandboxed; True when every test passes."""
    tools = detect()[p.language]
    with tempfile.TemporaryDirectory() as d:
        src = langs.unit(p.language, p.reference)
        Path(d, src).write_text(p.reference)
        build = None
        if p.language in langs.COMPILED:
            build = f"{d}/.build"
            os.mkdir(build)
            argv = langs.compile_argv(p.language, tools, src, build, 512)
            env = {"PATH": "/usr/bin:/bin", "HOME": d, **langs.compile_env(p.language, build)}
            if subprocess.run(argv, capture_output=True, cwd=d, env=env).returncode != 0:
                return False
        for t in p.tests:
            exe = langs.run_argv(p.language, tools, build, src, 512)
            if exe is None:  # python: the plain harness appends the assert to the program
                body = p.reference + ("\n" + t.assert_code if t.assert_code is not None else "")
                Path(d, src).write_text(body)
                exe = [tools["python3"], src]
            r = subprocess.run(
                exe, input=(t.stdin or "").encode(), capture_output=True, timeout=TIMEOUT_S, cwd=d
            )
            if r.returncode != 0:
                return False
            if t.expected_stdout is not None and _norm(r.stdout.decode()) != _norm(t.expected_stdout):
                return False
    return True


def widen(problems: list[Problem], at_least: int) -> list[Problem]:
    """`problems` repeated up to `at_least`, each copy's source different by trailing blank lines
    (so that no variant's build cache serves a copy; the plain harness builds every copy too)."""
    out = list(problems)
    k = 0
    while problems and len(out) < at_least:
        k += 1
        out += [replace(p, name=f"{p.name}~{k}", reference=p.reference + "\n" * k) for p in problems]
    return out[: max(at_least, len(problems))]


def request(p: Problem, core: int) -> ExecRequest:
    return ExecRequest(
        language=p.language,
        code=p.reference,
        test_cases=p.tests,
        timeout_s=TIMEOUT_S,
        compile_timeout_s=COMPILE_S,
        cores=(core,),
    )


def fresh_request(p: Problem, core: int) -> ExecRequest:
    """A Python problem as a request whose tests each start `python3` afresh (from bash); the
    harness still compares the output (an assert test prints PASS only if it ran through)."""
    files, cases = {}, []
    for i, t in enumerate(p.tests):
        body = p.reference
        if t.assert_code is not None:
            body += f"\n{t.assert_code}\nprint({PASS!r})\n"
        files[f"main_{i}.py"] = body
        expected = PASS if t.assert_code is not None else t.expected_stdout
        stdin = f"{i}\n" + (t.stdin or "")
        cases.append(TestCase(name=t.name, stdin=stdin, expected_stdout=expected))
    code = 'read -r i; exec /usr/bin/python3 "main_$i.py"'
    return ExecRequest(
        language="bash", code=code, files=files, test_cases=cases, timeout_s=TIMEOUT_S, cores=(core,)
    )


def box_solver(box: Any, fresh: bool = False) -> tuple[Solve, Prepare]:
    """Each round in a fresh sandbox per core (no builds carried over), started before the clock.
    Sandboxes are removed only when the variant ends (`box.close()`): a removal runs in the
    background shortly after it is asked for, and would land in the next timed round."""

    def traj(core: int, rnd: int) -> str:
        return f"bench-{core}-{rnd}"

    def prepare(core: int, rnd: int) -> None:
        box.run(traj(core, rnd), ExecRequest(language="python", code="pass", cores=(core,)))

    def solve(core: int, rnd: int, problems: list[Problem]) -> list[bool]:
        reqs = [fresh_request(p, core) if fresh else request(p, core) for p in problems]
        return [box.run(traj(core, rnd), r).status == "ok" for r in reqs]

    return solve, prepare


def bare_solver() -> tuple[Solve, Prepare, Callable[[], None]]:
    """Each round on a fresh runner per core (no builds carried over), started before the clock."""
    runners: dict[int, BareRunner] = {}

    def prepare(core: int, rnd: int) -> None:
        if core in runners:
            runners.pop(core).close()
        runners[core] = BareRunner(core)

    def solve(core: int, rnd: int, problems: list[Problem]) -> list[bool]:
        return [runners[core].run(request(p, core)).status == "ok" for p in problems]

    def close() -> None:
        for r in runners.values():
            r.close()

    return solve, prepare, close


def plain_solver(core: int, rnd: int, problems: list[Problem]) -> list[bool]:
    return [plain_solve(p) for p in problems]


def timed(solve: Solve, problems: list[Problem], rnd: int, prepare: Prepare | None) -> tuple[float, int]:
    """(seconds, number passed) with 2 workers, one per core."""
    halves = [problems[0::2], problems[1::2]]
    if prepare is not None:
        for core in (0, 1):
            prepare(core, rnd)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(lambda core: solve(core, rnd, halves[core]), [0, 1]))
    return time.perf_counter() - t0, sum(sum(x) for x in parts)


def plot(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(res["variants"])
    languages = list(res["languages"])
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        by = res["variants"][v]["by_language"]
        xs = [j + i * width for j, lang in enumerate(languages) if lang in by]
        ys = [by[lang]["tests_per_s"] for lang in languages if lang in by]
        ax.bar(xs, ys, width, label=v)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(languages))], languages)
    ax.set_yscale("log")
    ax.set_ylabel("tests / s on 2 cores (log)")
    ax.set_title("Correctness suite per language: sandbox vs unsandboxed runner vs plain harness")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def measure_interleaved(
    res: dict[str, Any],
    by_lang: dict[str, list[Problem]],
    variants: dict[str, tuple[Solve, Prepare | None, set[str] | None]],
    rounds: int,
) -> None:
    """Per language, `rounds` rounds, each running every variant in turn (so that all of them see
    the same load on a shared machine); the best round of each counts."""
    seconds: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    rnd = 0
    for lang, ps in by_lang.items():
        for _ in range(rounds):
            for name, (solve, prepare, only) in variants.items():
                if only is not None and lang not in only:
                    continue
                rnd += 1  # every (language, round, variant) gets fresh sandboxes / runners
                dt, passed = timed(solve, ps, rnd, prepare)
                if passed != len(ps):
                    raise SystemExit(f"ERROR: {name}/{lang}: {len(ps) - passed} reference solutions failed")
                seconds[name].setdefault(lang, []).append(dt)
        for name in variants:
            if lang in seconds[name]:
                best, n_tests = min(seconds[name][lang]), res["languages"][lang]["tests"]
                print(f"{name:16s} {lang:7s} {len(ps) / best:8.1f} problems/s {n_tests / best:8.1f} tests/s")
    for name in variants:
        by: dict[str, Any] = {}
        for lang, runs in seconds[name].items():
            best = min(runs)
            by[lang] = {
                "seconds": best,
                "problems_per_s": len(by_lang[lang]) / best,
                "tests_per_s": res["languages"][lang]["tests"] / best,
                "rounds_s": runs,
            }
        counted = sum(len(by_lang[lang]) for lang in by)
        res["variants"][name] = {
            "label": LABELS[name],
            "by_language": by,
            "problems_per_s": counted / sum(v["seconds"] for v in by.values()),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="best of this many rounds per variant and language")
    ap.add_argument("--docker-host", default=None, help="use this engine, not a private one")
    ap.add_argument("--no-docker", action="store_true", help="leave the Docker backend out")
    ap.add_argument(
        "--min-problems",
        type=int,
        default=12,
        help="repeat a language's problems up to this many (distinct copies)",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    problems = all_problems()
    by_lang = {
        lang: widen([p for p in problems if p.language == lang], args.min_problems) for lang in LANGUAGES
    }
    res: dict[str, Any] = {
        "problems": len(problems),
        "cores": 2,
        "rounds": args.rounds,
        "load_avg_start": list(os.getloadavg()),
        "labels": LABELS,
        "languages": {
            k: {
                "problems": len(v),  # measured, copies included
                "distinct": sum(p.language == k for p in problems),
                "tests": sum(len(p.tests) for p in v),
            }
            for k, v in by_lang.items()
        },
        "variants": {},
    }

    with contextlib.ExitStack() as stack:
        variants: dict[str, tuple[Solve, Prepare | None, set[str] | None]] = {
            "plain": (plain_solver, None, None)
        }
        bare, bare_prepare, bare_close = bare_solver()
        stack.callback(bare_close)
        variants["bare"] = (bare, bare_prepare, None)
        for name, fresh in (("namespace", False), ("namespace_fresh", True)):
            box = open_sandbox(SandboxConfig(backend="namespace", idle_ttl_s=3600))
            stack.callback(box.close)
            variants[name] = (*box_solver(box, fresh=fresh), {"python"} if fresh else None)
        if not args.no_docker:
            url = stack.enter_context(engine(args.docker_host))
            box = open_sandbox(SandboxConfig(backend="docker", docker_host=url, idle_ttl_s=3600))
            stack.callback(box.close)
            variants["docker"] = (*box_solver(box), None)
        measure_interleaved(res, by_lang, variants, args.rounds)
    res["load_avg_end"] = list(os.getloadavg())
    v = res["variants"]

    def faster(first: str, than: str, lang: str) -> float | None:
        """Throughput of `first` over `than` (> 1: `first` is faster), None if one is missing."""
        a, b = v.get(first, {}).get("by_language", {}), v.get(than, {}).get("by_language", {})
        return b[lang]["seconds"] / a[lang]["seconds"] if lang in a and lang in b else None

    pairs = [("namespace", "bare"), ("namespace", "plain"), ("namespace_fresh", "plain"), ("docker", "bare")]
    ratios: dict[str, dict[str, float]] = {}
    for lang in by_lang:
        r = {f"{a}_vs_{b}": faster(a, b, lang) for a, b in pairs}
        ratios[lang] = {k: x for k, x in r.items() if x is not None}
        print(f"{lang:7s} " + "  ".join(f"{k} {x:.2f}x" for k, x in ratios[lang].items()))
    res["ratios"] = ratios  # throughput ratios: > 1 means the first variant is faster
    path = write_json("problems", res)
    plot(res, RESULTS / "problems.png")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
