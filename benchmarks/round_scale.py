"""One scheduling round at scale (issue 39): 100 CPU nodes x 256 cores, 10,000 queued actions.

The round is `scheduler.round.Round.plan` with the production policy `tangram-fast` (fair
ordering, `decide`, core loans, time sharers, warm GPU placements: everything the live loop
and the simulator run each round), timed as the simulator times it (`SimResult.decision_s`).
Two figures:
- *in a run*: every round, while 10,000 or more actions wait, of a simulated coding run on
  100 nodes of 256 cores: `--batch` 30,000 trajectories of 1..2 turns and a test suite, all
  starting at once, so that the queue holds up to about 20,000 actions and stays above 10,000
  for a long stretch. A round runs at every event time (no round gap). This is the figure a
  live scheduler meets, round after round: most rounds start the few actions whose cores
  just came back.
- *burst*: a round on a busy cluster that has just got 4 cores back on every node (400 cores):
  running actions of 1..16 cores hold the rest; 10,000 queued actions of the coding mix of
  `benchmarks/paper_decision_time.py` (70% rigid shell commands, 25% runs elastic 1..8, 5% test
  suites elastic 1..32), 9,000 of them of trajectories pinned to nodes (round robin), 1,000 of
  new ones; a new queue, state and `Round` each time (nothing warm). It starts a few hundred
  actions at once.

    .venv/bin/python benchmarks/round_scale.py [--batch N] [--burst-rounds N]

Writes benchmarks/results/round_scale.json and round_scale.png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.common import RESULTS, percentile, write_json  # noqa: E402
from scheduler.duration import Amdahl  # noqa: E402
from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind  # noqa: E402
from scheduler.policies import get_policy  # noqa: E402
from scheduler.queue import WaitingQueue  # noqa: E402
from scheduler.resources import ClusterState, CpuNode  # noqa: E402
from scheduler.round import Round  # noqa: E402
from scheduler.sim import ClusterSpec, build, simulate  # noqa: E402

CORES, GROUPS, MEMORY_MB = 256, 2, 2_400_000


def queued(n: int, trajectories: int, seed: int = 0) -> list[QueuedAction]:
    """`n` coding actions (the mix in the module doc), one per trajectory: the first
    `trajectories` of running trajectories (`busy_state` pins them), the others new ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        if r < 0.70:
            units, t1, p, kind = Elastic.fixed(1), rng.lognormvariate(0.3, 1.0), 0.0, "shell"
        elif r < 0.95:
            units, t1, p, kind = Elastic.range(1, 8), rng.lognormvariate(1.8, 1.0), 0.8, "run"
        else:
            units, t1, p, kind = Elastic.range(1, 32), rng.lognormvariate(5.4, 0.8), 0.97, "tests"
        cost = CostVector(ResourceKind.CPU, units, memory_mb=4096, malleable=kind == "tests")
        tid = f"t{i}" if i < trajectories else f"n{i}"
        out.append(QueuedAction(f"a{i}", tid, cost, i * 1e-4, t1_s=t1, kind=kind, efficiency=Amdahl(p)))
    return out


def busy_state(nodes: int, free_per_node: int, pinned: int, seed: int = 1) -> ClusterState:
    """`nodes` nodes whose cores are held by running actions of 1..16 cores but for about
    `free_per_node` each; `pinned` trajectories pinned round robin (their sandboxes' memory)."""
    rng = random.Random(seed)
    state = ClusterState(
        cpu={f"cpu{k}": CpuNode.uniform(f"cpu{k}", CORES, MEMORY_MB, GROUPS) for k in range(nodes)}
    )
    i = 0
    for name, node in state.cpu.items():
        for group in node.numa:
            cores = sorted(group)[: len(group) - free_per_node // GROUPS]
            while cores:
                k = rng.randint(1, 16)
                take, cores = cores[:k], cores[k:]
                i += 1
                cost = CostVector(ResourceKind.CPU, Elastic.fixed(len(take)), memory_mb=4096)
                qa = QueuedAction(f"r{i}", f"rt{i}", cost, 0.0, t1_s=10.0, kind="run", efficiency=Amdahl(0.8))
                state.apply(Allocation(qa.action_id, ResourceKind.CPU, name, len(take), tuple(take)), qa, 0.0)
                state.expected_end_s[qa.action_id] = rng.uniform(0.1, 30.0)
    names = list(state.cpu)
    for t in range(pinned):
        node = state.cpu[names[t % len(names)]]
        state.pin(f"t{t}", node.name)
        node.trajectory_memory_mb[f"t{t}"] = 4096
    return state


def in_run(batch: int, nodes: int, min_queued: int) -> tuple[list[float], dict[str, float]]:
    """Round times (s) of a simulated run's rounds with `min_queued` or more waiting, and the
    run's figures (see the module doc)."""
    sc = build(
        "coding", {"batch": batch, "turns_min": 1, "turns_max": 2}, cluster=ClusterSpec(cpu_nodes=nodes)
    )
    t0 = time.perf_counter()
    result = simulate(sc, "tangram-fast")
    wall_s = time.perf_counter() - t0
    times = [d for d, q in zip(result.decision_s, result.queue_len, strict=True) if q >= min_queued]
    run = {
        "actions": sc.num_actions,
        "rounds": len(result.decision_s),
        "max_queued": max(result.queue_len),
        "wall_s": wall_s,
        "avg_act_s": result.avg_act_s(),
    }
    return times, run


def burst(args: argparse.Namespace, rounds: int) -> list[float]:
    """Round times (s), each on a new queue, state and `Round` (nothing warm)."""
    times = []
    for k in range(rounds):
        state = busy_state(args.nodes, args.free, args.pinned, seed=k)
        queue = WaitingQueue(queued(args.queued, args.pinned, seed=k))
        rnd = Round(get_policy("tangram-fast"))
        t0 = time.perf_counter()
        rnd.plan(queue, state, 1.0)
        times.append(time.perf_counter() - t0)
    return times


def stats(xs: list[float]) -> dict[str, float]:
    ms = [1000 * x for x in xs]
    return {
        "rounds": len(ms),
        "p50_ms": statistics.median(ms),
        "p90_ms": percentile(ms, 0.90),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batch", type=int, default=30_000, help="trajectories of the simulated run")
    ap.add_argument("--burst-rounds", type=int, default=11)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--queued", type=int, default=10_000)
    ap.add_argument("--free", type=int, default=4, help="cores back per node in the burst round")
    ap.add_argument("--pinned", type=int, default=9_000, help="queued actions of pinned trajectories")
    args = ap.parse_args()
    b = burst(args, args.burst_rounds)
    print(f"burst {stats(b)}", flush=True)
    r, run = in_run(args.batch, args.nodes, args.queued)
    out = {
        "setup": {
            "nodes": args.nodes,
            "cores_per_node": CORES,
            "queued": args.queued,
            "policy": "tangram-fast",
            "run_batch": args.batch,
            "burst_free_cores_per_node": args.free,
            "burst_pinned": args.pinned,
        },
        "in_run": {**stats(r), "run": run},
        "burst": stats(b),
        "target_p50_ms": 10.0,
        "met": statistics.median(r) * 1000 <= 10.0,
    }
    path = write_json("round_scale", out)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ms = sorted(1000 * x for x in r)
    ax.plot(ms, [i / len(ms) for i in range(len(ms))], label=f"in a run ({len(ms):,} rounds)")
    bs = sorted(1000 * x for x in b)
    ax.plot(bs, [i / len(bs) for i in range(len(bs))], "o-", label=f"burst ({len(bs)} rounds)")
    ax.axvline(10.0, color="k", ls="--", lw=1, label="target p50 10 ms")
    ax.set_xscale("log")
    ax.set_xlabel("round time (ms)")
    ax.set_ylabel("share of rounds")
    ax.set_title(f"tangram-fast, {args.nodes} x {CORES} cores, {args.queued:,}+ queued")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "round_scale.png", dpi=120)
    print(f"in run {out['in_run']}\nburst {out['burst']}\nwrote {path}")


if __name__ == "__main__":
    main()
