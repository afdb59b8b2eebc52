"""Choose each HumanEval problem's broken variant: `python -m tests.problems.build`.

For every problem, applies MUTATIONS in order and keeps the first whose tests fail (run in a
plain local subprocess with a 5 s limit); `raise NotImplementedError` (-1) when none does.
Writes tests/problems/broken.json. Only needed when the mutation list or the data change.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from tests.problems import BROKEN_FILE, MUTATIONS, humaneval_rows, humaneval_test, mutate


def fails(prompt: str, solution: str, test: str) -> bool:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", prompt + solution + "\n" + test], capture_output=True, timeout=5
        )
    except subprocess.TimeoutExpired:
        return False  # a hang is a broken solution too, but a slow one: prefer a fast failure
    return proc.returncode != 0


def choose(row: dict) -> int:
    test = humaneval_test(row).assert_code or ""
    assert not fails(row["prompt"], row["canonical_solution"], test), row["task_id"]
    for i in range(len(MUTATIONS)):
        broken = mutate(row["canonical_solution"], i)
        if broken is not None and broken != row["canonical_solution"]:
            try:
                compile(row["prompt"] + broken, "x", "exec")
            except SyntaxError:
                continue
            if fails(row["prompt"], broken, test):
                return i
    return -1


def main() -> None:
    rows = humaneval_rows()
    with ThreadPoolExecutor(4) as pool:
        picks = dict(zip([r["task_id"] for r in rows], pool.map(choose, rows), strict=True))
    BROKEN_FILE.write_text(json.dumps(picks, indent=0, sort_keys=True) + "\n")
    fallback = sum(1 for v in picks.values() if v == -1)
    print(f"{len(picks)} problems, {fallback} use the NotImplementedError fallback")


if __name__ == "__main__":
    main()
