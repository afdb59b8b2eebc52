"""What a fork costs in the sandbox: page faults and CPU per HumanEval program, by process kind,
and what one page fault costs on this machine.

A sandbox's user processes are forks of its zygote and a new occupant's verifier is a fork of
the sandbox's verifier seed (docs/sandbox.md, "Why a seed"); each pays a page fault for every
page it writes that it shares with its parent (copy-on-write) or that is new. This measures,
at the sandbox API (`open_sandbox`, namespace backend, 2 ready sandboxes; no scheduler or
worker), over the 164 HumanEval reference programs with their assert tests on core 0:
1. `warm`: all in one trajectory (its verifier is reused, no new sandbox);
   `fresh`: each as a new trajectory closed after its action (the worker's eviction): a
   recycled sandbox, scrubbed, with a verifier forked for the new occupant;
   per program, from /proc: the minor faults and CPU of the zygotes and the user processes they
   reaped (`zygote`), of the seeds and the verifiers they reaped (`seed`), and of the runners;
2. the cost of one page fault in a forked child: a child writing one byte to each of N pages
   it shares with its parent (a copy each) or of a fresh mapping (a zero-filled page each),
   against a child that only loops, median of `--reps` children per kind.
Counts are deterministic to a few faults; CPU and the per-fault cost follow the machine.

Run: .venv/bin/python benchmarks/fork_faults.py [--rounds 3] [--name fork_faults]
Writes benchmarks/results/<name>.json and <name>.png.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, write_json
from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.config import SandboxConfig
from tangram_celery.sandbox import ExecRequest, Sandbox, open_sandbox
from tests.problems import Problem, humaneval_problems

KINDS = {"tangram-zygote": "zygote", "tangram-vseed": "seed", "python3": "runner"}
PAGE = 4096


def _stat(pid: int) -> tuple[str, int, float] | None:
    """(comm, minor faults of it and its reaped children, CPU seconds of the same)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    f = text[text.rindex(")") + 2 :].split()
    hz = os.sysconf("SC_CLK_TCK")
    return comm, int(f[7]) + int(f[8]), (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / hz


def _descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                text = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            ppid = int(text[text.rindex(")") + 2 :].split()[1])
            kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def reading() -> dict[tuple[int, str], tuple[int, float]]:
    """(pid, kind) -> (faults, CPU s) for this process's sandbox processes of the kinds measured."""
    out = {}
    for pid in _descendants(os.getpid()):
        st = _stat(pid)
        if st is not None and st[0] in KINDS:
            out[(pid, KINDS[st[0]])] = (st[1], st[2])
    return out


def between(
    a: dict[tuple[int, str], tuple[int, float]], b: dict[tuple[int, str], tuple[int, float]], n: int
) -> dict[str, dict[str, float]]:
    """Per kind: faults and CPU ms per program between two readings (processes that ended in
    between count through the parent that reaped them)."""
    out: dict[str, dict[str, float]] = {k: {"faults": 0.0, "cpu_ms": 0.0} for k in KINDS.values()}
    for key, (faults, cpu) in b.items():
        f0, c0 = a.get(key, (0, 0.0))
        out[key[1]]["faults"] += (faults - f0) / n
        out[key[1]]["cpu_ms"] += 1000 * (cpu - c0) / n
    return out


def request(p: Problem) -> ExecRequest:
    return ExecRequest(
        language="python", code=p.reference, test_cases=p.tests, cores=(0,), memory_mb=512, timeout_s=30
    )


def programs(box: Sandbox, problems: list[Problem], variant: str) -> dict[str, Any]:
    tid = f"warm-{uuid.uuid4().hex[:8]}"
    assert box.run(tid, request(problems[0])).status is ActionStatus.OK
    time.sleep(0.5)
    before, t0 = reading(), time.perf_counter()
    for p in problems:
        if variant == "warm":
            res = box.run(tid, request(p))
        else:
            fresh = f"fresh-{uuid.uuid4().hex[:8]}"
            res = box.run(fresh, request(p))
            box.close_trajectory(fresh)
        assert res.status is ActionStatus.OK, (p.name, res)
    wall = time.perf_counter() - t0
    time.sleep(0.5)  # scrubs and primes of the last closes
    out: dict[str, Any] = between(before, reading(), len(problems))
    out["wall_ms_per_program"] = 1000 * wall / len(problems)
    box.close_trajectory(tid)
    return out


def _child_cpu_us(body: Any, reps: int) -> float:
    """Median CPU µs of a forked child running `body` (its own reading, sent over a pipe)."""
    times = []
    for _ in range(reps):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            t0 = time.thread_time_ns()
            body()
            os.write(w, str(time.thread_time_ns() - t0).encode())
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        times.append(int(os.read(r, 64)) / 1000)
        os.close(r)
    return statistics.median(times)


def fault_cost(pages: int, reps: int) -> dict[str, float]:
    """µs per copy-on-write fault and per zero-fill fault in a forked child."""
    shared = mmap.mmap(-1, pages * PAGE)
    for i in range(0, pages * PAGE, PAGE):
        shared[i] = 1

    def loop() -> None:
        m = bytearray(1)
        for _ in range(0, pages * PAGE, PAGE):
            m[0] = 2

    def cow() -> None:
        for i in range(0, pages * PAGE, PAGE):
            shared[i] = 2

    def zero() -> None:
        m = mmap.mmap(-1, pages * PAGE)
        for i in range(0, pages * PAGE, PAGE):
            m[i] = 2

    base = _child_cpu_us(loop, reps)
    return {
        "pages": pages,
        "copy_us_per_fault": (_child_cpu_us(cow, reps) - base) / pages,
        "zero_fill_us_per_fault": (_child_cpu_us(zero, reps) - base) / pages,
    }


def plot(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    kinds = ["zygote", "seed", "runner"]
    x = range(len(kinds))
    for off, variant, color in ((-0.2, "warm", "tab:gray"), (0.2, "fresh", "tab:blue")):
        vals = [res["median"][variant][k]["faults"] for k in kinds]
        ax.bar([i + off for i in x], vals, width=0.4, color=color, label=f"{variant} trajectory")
    ax.set_xticks(list(x), ["zygote + user processes", "seed + verifiers", "runner"])
    ax.set_ylabel("page faults per HumanEval program")
    cost = res["fault_cost"]
    ax.set_title(
        f"a page fault costs {cost['copy_us_per_fault']:.1f} µs (copy), "
        f"{cost['zero_fill_us_per_fault']:.1f} µs (zero-fill) here",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each variant (medians reported)")
    ap.add_argument("--reps", type=int, default=30, help="children per kind for the per-fault cost")
    ap.add_argument("--name", default="fork_faults", help="result file name")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    problems = humaneval_problems()
    box = open_sandbox(SandboxConfig(backend="namespace", prewarm=2))
    rounds: dict[str, list[dict[str, Any]]] = {"warm": [], "fresh": []}
    try:
        for r in range(args.rounds):
            for variant in rounds:
                out = programs(box, problems, variant)
                rounds[variant].append(out)
                print(
                    f"round {r + 1} {variant:5s} {out['wall_ms_per_program']:5.1f} ms/program; faults/program: "
                    + ", ".join(f"{k} {out[k]['faults']:.0f}" for k in ("zygote", "seed", "runner"))
                )
    finally:
        box.close()
    median = {
        v: {
            k: {m: statistics.median(x[k][m] for x in rs) for m in ("faults", "cpu_ms")}
            for k in ("zygote", "seed", "runner")
        }
        for v, rs in rounds.items()
    }
    res: dict[str, Any] = {
        "programs": len(problems),
        "rounds": rounds,
        "median": median,
        "fault_cost": fault_cost(1024, args.reps),
    }
    cost = res["fault_cost"]
    print(
        f"median faults/program, fresh: zygote {median['fresh']['zygote']['faults']:.0f}, "
        f"seed {median['fresh']['seed']['faults']:.0f}; a fault: {cost['copy_us_per_fault']:.2f} µs (copy), "
        f"{cost['zero_fill_us_per_fault']:.2f} µs (zero-fill)"
    )
    path = write_json(args.name, res)
    plot(res, RESULTS / f"{args.name}.png")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
