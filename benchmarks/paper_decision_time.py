"""Decision time per scheduling round: inside simulated runs, built fresh, and the warm best case.

1. Inside a simulated run (the figure a user meets): every round of a coding run at the paper's
   scale (batch 1280, 15 x 256 cores) under tangram-fast and tangram-dp, and of the ~10^5-action
   run (coding, batch 6400 on 25 x 256 cores, tangram-fast): p50/p90/p99/max over all rounds.
2. The headline round built fresh each time: a new queue (a `WaitingQueue` of 1280 coding
   actions: 70% rigid shell, 25% runs elastic 1..8, 5% test suites elastic 1..32), a new policy
   and a new 256-core node (2 NUMA groups) for every round, so no memo or index is warm; the
   median and p90 of 21 such rounds.
3. The best case, labelled as such: one queue reused for 21 identical rounds (memo and index
   warm after the first), median per run, best of 3 runs; against queue length and core count.
Then the wall time of the ~10^5-action simulation. All are absolute times, so the JSON records
how fast this machine runs plain Python (`provenance.machine_us`: best of 5 of
`sum(range(10000))`; about 120-150 us on a current 3 GHz core).

    .venv/bin/python benchmarks/paper_decision_time.py [--against GIT-REV]

`--against REV` also times git revision REV's code side by side (a temporary worktree), the
headline round alternating between the two trees: absolute times on a shared VM drift within
minutes, ratios measured together do not.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
from paper_common import png, run, save

from benchmarks.common import machine_us
from scheduler.duration import Amdahl
from scheduler.model import CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import get_policy
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState, CpuNode
from scheduler.sim import ClusterSpec, build, simulate

POLICIES = ["tangram-fast", "tangram-dp"]
ROUNDS = 21
REPEATS = 3


def make_queue(n: int, seed: int = 0) -> list[QueuedAction]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        if r < 0.70:
            units, t1, p = Elastic.fixed(1), rng.lognormvariate(0.3, 1.0), 0.0
        elif r < 0.95:
            units, t1, p = Elastic.range(1, 8), rng.lognormvariate(1.8, 1.0), 0.8
        else:
            units, t1, p = Elastic.range(1, 32), rng.lognormvariate(5.4, 0.8), 0.97
        cost = CostVector(ResourceKind.CPU, units, memory_mb=4096)
        out.append(QueuedAction(f"a{i}", f"t{i}", cost, 0.0, t1_s=t1, efficiency=Amdahl(p)))
    return out


def median_ms(policy: str, queue: list[QueuedAction], cores: int) -> float:
    """Median of `ROUNDS` rounds, best of `REPEATS` such runs.

    Noise on a shared VM only ever adds time, and it comes in spells of seconds to minutes
    (the yardstick below varied from 280 to 510 us within an hour on 2026-11-23), so the best
    of a few medians is the figure that describes the code rather than the neighbours.
    """
    state = ClusterState(cpu={"n0": CpuNode.uniform("n0", cores, 10_000_000, 2)})
    pol = get_policy(policy)
    waiting = WaitingQueue(queue)  # as the simulator and the live scheduler keep it
    medians = []
    for _ in range(REPEATS):
        times = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            pol.decide(waiting, state, 1.0)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return 1000 * min(medians)


def fresh_round_ms(policy: str, n: int = 1280, cores: int = 256) -> dict[str, float]:
    """Median and p90 ms of `ROUNDS` rounds, each on a queue, policy and node built anew (cold)."""
    times = []
    for _ in range(ROUNDS):
        waiting = WaitingQueue(make_queue(n))
        state = ClusterState(cpu={"n0": CpuNode.uniform("n0", cores, 10_000_000, 2)})
        pol = get_policy(policy)
        t0 = time.perf_counter()
        pol.decide(waiting, state, 1.0)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"median_ms": 1000 * statistics.median(times), "p90_ms": 1000 * times[int(0.9 * len(times))]}


def in_run(summary: dict[str, float]) -> dict[str, float]:
    """The decision-time distribution of a simulated run, from its summary."""
    keys = ("rounds", "decision_median_ms", "decision_p90_ms", "decision_p99_ms", "decision_max_ms")
    return {k: float(summary[k]) for k in keys}


_IN_TREE = """
import json, random, statistics, sys, time
sys.path.insert(0, {root!r})
import scheduler
assert scheduler.__file__.startswith({root!r}), scheduler.__file__
from scheduler.duration import Amdahl
from scheduler.model import CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import get_policy
from scheduler.resources import ClusterState, CpuNode
from scheduler.sim import ClusterSpec, build, simulate
{make_queue}
if {sim!r}:
    sc = build("coding", {{"batch": 6400}}, cluster=ClusterSpec(cpu_nodes=25))
    t0 = time.perf_counter()
    simulate(sc, "tangram-fast")
    print(json.dumps(time.perf_counter() - t0))
else:
    queue = make_queue(1280)
    try:  # the queue as that tree's simulator keeps it
        from scheduler.queue import WaitingQueue
        queue = WaitingQueue(queue)
    except ImportError:
        pass
    state = ClusterState(cpu={{"n0": CpuNode.uniform("n0", 256, 10_000_000, 2)}})
    pol = get_policy("tangram-fast")
    times = []
    for _ in range({rounds}):
        t0 = time.perf_counter()
        pol.decide(queue, state, 1.0)
        times.append(time.perf_counter() - t0)
    print(json.dumps(1000 * statistics.median(times)))
"""


def _in_tree(root: Path, sim: bool) -> float:
    """The headline round (median ms) or the 10^5 simulation (s), with the code under `root`."""
    code = _IN_TREE.format(root=str(root), make_queue=inspect.getsource(make_queue), sim=sim, rounds=ROUNDS)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def against(rev: str, runs: int = 3) -> dict[str, object]:
    """This tree against git revision `rev`, side by side: the headline round `runs` times each,
    alternating (the machine's speed drifts), then the 10^5-action simulation once each."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "--detach", str(other), rev],
            check=True,
            capture_output=True,
        )
        try:
            trees = {"this": root, rev: other}
            rounds: dict[str, list[float]] = {name: [] for name in trees}
            for i in range(runs):
                for name, tree in trees.items():
                    rounds[name].append(_in_tree(tree, sim=False))
                    print(f"  against {rev}: run {i + 1}, {name}: {rounds[name][-1]:.2f} ms", flush=True)
            sims = {}
            for name, tree in trees.items():
                sims[name] = _in_tree(tree, sim=True)
                print(f"  against {rev}: 10^5 simulated actions, {name}: {sims[name]:.1f} s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(other)], check=False)
    ours, theirs = statistics.median(rounds["this"]), statistics.median(rounds[rev])
    return {
        "rev": rev,
        "round_ms": rounds,
        "round_speedup": theirs / ours,
        "sim_s": sims,
        "sim_speedup": sims[rev] / sims["this"],
        "machine_us": machine_us(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", metavar="REV", help="also time git revision REV side by side")
    args = parser.parse_args()
    speed = machine_us()
    print(f"  machine: sum(range(10000)) in {speed:.0f} us")
    lengths = [80, 160, 320, 640, 1280]
    cores = [64, 128, 256, 512]
    by_len = {p: [median_ms(p, make_queue(n), 256) for n in lengths] for p in POLICIES}
    by_cores = {p: [median_ms(p, make_queue(1280), c) for c in cores] for p in POLICIES}
    for p in POLICIES:
        print(f"  {p:<14} queue {lengths}: {[round(x, 2) for x in by_len[p]]} ms")
        print(f"  {p:<14} cores {cores}: {[round(x, 2) for x in by_cores[p]]} ms")
    headline = {
        "fast_ms_1280_queue_256_cores": by_len["tangram-fast"][-1],
        "dp_ms_1280_queue_256_cores": by_len["tangram-dp"][-1],
    }
    headline["dp_over_fast"] = (
        headline["dp_ms_1280_queue_256_cores"] / headline["fast_ms_1280_queue_256_cores"]
    )
    print(f"  best case (warm, best of {REPEATS} medians): {headline}")
    fresh = {p: fresh_round_ms(p) for p in POLICIES}
    print(f"  headline round built fresh each time: {fresh}")

    coding = build("coding", {"batch": 1280})  # the paper's scale: 15 x 256 cores
    runs = {f"coding_1280_{p}": in_run(run(coding, p)[1]) for p in POLICIES}
    sc = build("coding", {"batch": 6400}, cluster=ClusterSpec(cpu_nodes=25))
    t0 = time.perf_counter()
    result = simulate(sc, "tangram-fast")
    sim = {
        "actions": len(result.records),
        "wall_s": time.perf_counter() - t0,
        "rounds": len(result.decision_s),
        "machine_us_after": machine_us(),
    }
    runs["coding_6400_tangram-fast"] = in_run(result.summary())
    for k, v in runs.items():
        print(f"  in the run {k}: {v}")
    print(f"  simulated {sim['actions']} actions in {sim['wall_s']:.1f} s")

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for p in POLICIES:
        a.plot(lengths, by_len[p], marker="o", label=p)
        b.plot(cores, by_cores[p], marker="o", label=p)
    a.set(xlabel="queued actions (256 cores)", ylabel="median decision time (ms)", yscale="log")
    b.set(xlabel="cores on the node (1280 queued)", ylabel="median decision time (ms)", yscale="log")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(png("paper_decision_time"), dpi=110)
    save(
        "paper_decision_time",
        {
            "queue_lengths": lengths,
            "by_queue_ms": by_len,
            "cores": cores,
            "by_cores_ms": by_cores,
            "headline": headline,
            "headline_fresh_ms": fresh,
            "in_run_ms": runs,
            "simulation": sim,
            "machine_us": speed,
            **({"against": against(args.against)} if args.against else {}),
        },
    )


if __name__ == "__main__":
    main()
