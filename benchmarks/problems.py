"""Correctness-suite throughput on 2 cores: sandboxed vs a plain unsandboxed subprocess harness.

The same problems (HumanEval + C/bash, reference solutions, all tests) run three ways, each with
2 workers (one per core), side by side in one run:
- local: a plain harness, no isolation: per test a fresh `python3 file.py` / `bash -c` / binary
  (C compiled once per problem) in a temp dir, via subprocess;
- docker: the Docker backend, each worker one warm trajectory sandbox bound to its core;
- namespace: the bubblewrap backend, same.
Target: sandboxed throughput >= local. Every result must pass (else the run fails).

Run: .venv/bin/python benchmarks/problems.py [--rounds 3]
Writes benchmarks/results/problems.json and problems.png.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, write_json
from benchmarks.sandbox import engine
from tangram_celery.config import SandboxConfig
from tangram_celery.sandbox import ExecRequest, open_sandbox
from tests.problems import Problem, all_problems

PY = "/usr/bin/python3"  # the interpreter the sandboxes run, for a fair comparison
TIMEOUT_S = 10.0


def _norm(s: str) -> str:
    return "\n".join(x.rstrip() for x in s.strip().splitlines())


def local_solve(p: Problem) -> bool:
    """Run one problem with plain subprocesses; True when every test passes."""
    with tempfile.TemporaryDirectory() as d:
        exe: list[str] = []
        if p.language == "c":
            Path(d, "main.c").write_text(p.reference)
            cc = subprocess.run(
                ["gcc", "-O2", "-pipe", "-o", f"{d}/main", f"{d}/main.c", "-lm"], capture_output=True
            )
            if cc.returncode != 0:
                return False
            exe = [f"{d}/main"]
        elif p.language == "bash":
            Path(d, "main.sh").write_text(p.reference)
            exe = ["bash", f"{d}/main.sh"]
        for t in p.tests:
            if t.assert_code is not None:
                Path(d, "main.py").write_text(p.reference + "\n" + t.assert_code)
                exe = [PY, f"{d}/main.py"]
            elif p.language == "python":
                Path(d, "main.py").write_text(p.reference)
                exe = [PY, f"{d}/main.py"]
            r = subprocess.run(
                exe, input=(t.stdin or "").encode(), capture_output=True, timeout=TIMEOUT_S, cwd=d
            )
            if r.returncode != 0:
                return False
            if t.expected_stdout is not None and _norm(r.stdout.decode()) != _norm(t.expected_stdout):
                return False
    return True


def sandbox_solver(box: Any) -> Any:
    def solve(core: int, problems: list[Problem]) -> list[bool]:
        traj = f"bench-{core}"
        out = []
        for p in problems:
            req = ExecRequest(
                language=p.language, code=p.reference, test_cases=p.tests, timeout_s=TIMEOUT_S, cores=(core,)
            )
            out.append(box.run(traj, req).status == "ok")
        return out

    return solve


def throughput(solve_half: Any, problems: list[Problem]) -> tuple[float, int]:
    """(problems per second, number passed) with 2 workers, one per core."""
    halves = [problems[0::2], problems[1::2]]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(solve_half, [0, 1], halves))
    dt = time.perf_counter() - t0
    return len(problems) / dt, sum(sum(x) for x in parts)


def plot(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["local", "docker", "namespace"]
    vals = [res[n]["problems_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(names, vals, color=["tab:gray", "tab:blue", "tab:green"])
    ax.set_ylabel("problems / s on 2 cores")
    for x, v in enumerate(vals):
        ax.text(x, v, f"{v:.0f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="best of this many rounds per variant")
    ap.add_argument("--docker-host", default=None, help="use this engine, not a private one")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    problems = all_problems()
    n = len(problems)
    res: dict[str, Any] = {"problems": n, "cores": 2}

    def local_half(_core: int, ps: list[Problem]) -> list[bool]:
        return [local_solve(p) for p in ps]

    with engine(args.docker_host) as url:
        variants = {
            "local": None,
            "docker": SandboxConfig(backend="docker", docker_host=url),
            "namespace": SandboxConfig(backend="namespace"),
        }
        for name, cfg in variants.items():
            box = open_sandbox(cfg) if cfg is not None else None
            try:
                solve = sandbox_solver(box) if box is not None else local_half
                runs = [throughput(solve, problems) for _ in range(args.rounds)]
            finally:
                if box is not None:
                    box.close()
            best = max(r[0] for r in runs)
            passed = min(r[1] for r in runs)
            res[name] = {"problems_per_s": best, "passed": passed, "rounds": args.rounds}
            print(f"{name:10s} {best:7.1f} problems/s  ({passed}/{n} passed)")
            if passed != n:
                print(f"ERROR: {name}: {n - passed} reference solutions failed")
                return 1
    for name in ("docker", "namespace"):
        res[f"ratio_{name}_vs_local"] = res[name]["problems_per_s"] / res["local"]["problems_per_s"]
        print(f"{name} / local = {res[f'ratio_{name}_vs_local']:.2f}x (target >= 1)")
    path = write_json("problems", res)
    plot(res, RESULTS / "problems.png")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
