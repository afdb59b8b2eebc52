"""A digest of every scheduling decision of fixed simulations, to prove a change keeps them.

Runs the coding, MOPD and DeepSearch scenarios (small batches, fixed seeds) under
`tangram-fast`, `tangram-dp` and `fcfs-min`, hashes every allocation of every round (time,
action, pool, units, unit ids, and evictions when there are any) and prints one SHA-256 and the
average ACT per run. The same code run over another git revision (`--against REV`, a temporary
worktree) must print the same lines when a change is meant not to alter decisions.

    .venv/bin/python benchmarks/decision_digest.py [--against GIT-REV]

Writes benchmarks/results/decision_digest.json (both trees' lines with `--against`).

It also runs a memory-short coding case (`coding-memshort`: 8 trajectories' worth of sandbox
memory per node), whose decisions do change when memory handling changes; it is listed for
information and left out of the comparison's verdict. And a MOPD case with a bounded host-memory
tier (`mopd-host`: 2 TiB per node, issue 38), where the policies' tier-aware placement runs; a
tree older than the host tier has no such case, and it is compared only where both trees ran it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_json  # noqa: E402

# Runs inside the tree under test (its own scheduler package), prints one JSON line per run.
_RUN = r"""
import hashlib, json, sys
sys.path.insert(0, {root!r})
import scheduler
assert scheduler.__file__.startswith({root!r}), scheduler.__file__
from scheduler.policies import get_policy
from scheduler.sim import ClusterSpec, build
from scheduler.sim.engine import Simulator

CASES = [
    ("coding", "coding", {{"batch": 192}}, ClusterSpec(cpu_nodes=2, cores_per_node=64)),
    ("coding-memshort", "coding", {{"batch": 96}},
     ClusterSpec(cpu_nodes=2, cores_per_node=64, memory_mb_per_node=8 * 4096)),
    ("mopd", "mopd", {{"batch": 1024}}, ClusterSpec(cpu_nodes=0, gpus_total=16)),
    ("deepsearch", "deepsearch", {{"batch": 512}}, None),
]
try:  # a tree with a host tier (issue 38)
    CASES.append(("mopd-host", "mopd", {{"batch": 1024}},
                  ClusterSpec(cpu_nodes=0, gpus_total=16, host_memory_mb=2 * 1024 * 1024)))
except TypeError:
    pass

class Recorder:
    def __init__(self, inner):
        self.inner, self.name, self.h, self.rounds = inner, inner.name, hashlib.sha256(), 0
        for attr in ("cpu_sharing", "gpu_residency", "api_control", "execution"):
            if hasattr(inner, attr):
                setattr(self, attr, getattr(inner, attr))
    def decide(self, queue, state, now_s):
        out = self.inner.decide(queue, state, now_s)
        self.rounds += 1
        rows = []
        for a in out:
            row = [a.action_id, str(a.kind), a.pool, a.units, list(a.unit_ids)]
            evict = getattr(a, "evict", ())
            if evict:
                row.append(list(evict))
            rows.append(row)
        self.h.update(json.dumps([repr(now_s), rows]).encode())
        return out

for label, name, params, cluster in CASES:
    kw = {{"cluster": cluster}} if cluster is not None else {{}}
    sc = build(name, params, **kw)
    for policy in ("tangram-fast", "tangram-dp", "fcfs-min"):
        rec = Recorder(get_policy(policy))
        res = Simulator(sc, rec).run()
        s = res.summary()
        print(json.dumps({{"case": label, "policy": policy, "rounds": rec.rounds,
                          "digest": rec.h.hexdigest()[:16], "avg_act_s": repr(s["avg_act_s"])}}),
              flush=True)
"""


def run_tree(root: Path) -> list[dict[str, str]]:
    """Every case's digest line, computed by the code under `root`."""
    out = subprocess.run(
        [sys.executable, "-c", _RUN.format(root=str(root))], check=True, capture_output=True, text=True
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", metavar="REV", help="also run git revision REV and compare")
    args = ap.parse_args()
    ours = run_tree(ROOT)
    for r in ours:
        print(f"{r['case']:<16} {r['policy']:<13} rounds={r['rounds']:>6} {r['digest']} act={r['avg_act_s']}")
    if not args.against:
        write_json("decision_digest", {"runs": ours})
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), args.against],
            check=True,
            capture_output=True,
        )
        try:
            theirs = run_tree(other)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False)
    differ = []
    write_json("decision_digest", {"runs": ours, "against": args.against, "theirs": theirs})
    keys = {(b["case"], b["policy"]) for b in theirs}
    ours_shared = [a for a in ours if (a["case"], a["policy"]) in keys]
    for a, b in zip(ours_shared, theirs, strict=True):
        same = (a["digest"], a["avg_act_s"]) == (b["digest"], b["avg_act_s"])
        mark = "same" if same else "DIFFERENT"
        print(
            f"{a['case']:<16} {a['policy']:<13} vs {args.against}: {mark} ({b['digest']} act={b['avg_act_s']})"
        )
        if not same and a["case"] != "coding-memshort":
            differ.append(f"{a['case']}/{a['policy']}")
    if differ:
        print(f"decisions differ from {args.against}: {', '.join(differ)}")
        return 1
    print(f"every decision is the same as {args.against}'s (memory-short case excepted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
