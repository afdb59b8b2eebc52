"""What tier-aware GPU placement costs (issue 38): one scheduling round, and a simulated run.

1. One round with host tiers on: 40 GPUs (5 nodes of 8), 10 services, 2,048 queued reward
   calls (elastic over 1/2/4/8 GPUs). Every GPU holds one service resident; 6 of 8 per node are
   busy until 0.05-0.5 s from now; the 2 free ones keep one of the least called services in
   host memory. Most calls then weigh a cold load against waiting for their busy chunk: the
   path `scheduler.policies.gpu_aware.Tiers` takes. Prints the median seconds of
   `gpu_candidates` and of `tangram-fast`'s `decide` and a digest of their allocations.
2. `tangram-fast` on MOPD at batch 2048 on 40 GPUs, with unbounded host memory (the tiers off)
   and with 2 TiB and 1 TiB per node (the tiers on): wall and CPU seconds per run.

    .venv/bin/python benchmarks/gpu_tiers_round.py [--root OTHER-CHECKOUT] [--repeats N]

`--root` times another checkout's `scheduler` (e.g. `git worktree add /tmp/old 82f1296`) with
the same inputs: the digests must match when a change is meant to keep decisions.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERVICES = [f"teacher{k}" for k in range(10)]
HOST_BUDGETS_MB = (None, 2_097_152, 1_048_576)


def _round_inputs() -> tuple[list[Any], Callable[[], Any]]:
    """The 2,048 queued calls and a function building the cluster state (fresh per repeat),
    from the `scheduler` on `sys.path`."""
    from scheduler.duration import Table
    from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
    from scheduler.pools import GpuNode
    from scheduler.resources import ClusterState
    from scheduler.restore_cost import RestoreCosts
    from scheduler.sim.scenarios import TP_EFFICIENCY

    rng, curve = random.Random(7), Table(TP_EFFICIENCY)

    def call(aid: str, service: str, t1_s: float) -> QueuedAction:
        cost = CostVector(ResourceKind.GPU, Elastic((1, 2, 4, 8)), gpu_memory_mb=16_000)
        return QueuedAction(
            aid, f"t-{aid}", cost, 0.0, t1_s=t1_s, kind=f"reward:{service}", target=service, efficiency=curve
        )

    def state() -> ClusterState:
        ends = random.Random(11)
        costs = RestoreCosts()
        nodes = {f"g{n}": GpuNode(f"g{n}", 8, 80_000, restore_costs=costs, host_tier=True) for n in range(5)}
        out = ClusterState(gpu=nodes)
        for n, node in enumerate(nodes.values()):
            for gpu in range(8):
                service = SERVICES[(n * 8 + gpu) % 10]
                node.resident[(gpu,)] = [service]
                if gpu >= 6:  # free, with one of the least called services in host memory
                    node.host_resident[(gpu,)] = [SERVICES[7 + (n + gpu) % 3]]
                    continue
                holder = call(f"h{n}-{gpu}", service, 0.5)
                out.apply(Allocation(holder.action_id, ResourceKind.GPU, node.name, 1, (gpu,)), holder, 0.0)
                out.expected_end_s[holder.action_id] = ends.uniform(0.05, 0.5)
        return out

    weights = [0.5**i for i in range(10)]
    queue = [
        call(f"a{i}", rng.choices(SERVICES, weights)[0], rng.lognormvariate(-0.7, 0.5)) for i in range(2048)
    ]
    return queue, state


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--root", default=str(ROOT), help="checkout whose scheduler is timed")
    ap.add_argument("--repeats", type=int, default=21, help="rounds timed per function")
    ap.add_argument("--no-sim", action="store_true", help="only the round, not the simulated runs")
    args = ap.parse_args()
    root = str(Path(args.root).resolve())
    sys.path.insert(0, root)
    import scheduler

    assert scheduler.__file__ and scheduler.__file__.startswith(root), scheduler.__file__
    from scheduler.policies import get_policy
    from scheduler.policies.gpu_aware import gpu_candidates
    from scheduler.sim import ClusterSpec, build
    from scheduler.sim.engine import Simulator

    queue, state = _round_inputs()
    print(f"scheduler from {root}")
    rounds = (("gpu_candidates", gpu_candidates), ("tangram-fast decide", get_policy("tangram-fast").decide))
    for label, fn in rounds:
        times, out = [], []
        for _ in range(args.repeats):
            s = state()
            t0 = time.perf_counter()
            out = fn(queue, s, 0.0)
            times.append(time.perf_counter() - t0)
        digest = hashlib.sha256(repr([(a.action_id, a.pool, a.unit_ids) for a in out]).encode()).hexdigest()[
            :16
        ]
        print(
            f"round, {label}: median {statistics.median(times) * 1e3:.2f} ms over {args.repeats} "
            f"(min {min(times) * 1e3:.2f}), {len(out)} placed, digest {digest}"
        )
    if args.no_sim:
        return
    for mb in HOST_BUDGETS_MB:
        sc = build(
            "mopd", {"batch": 2048}, cluster=ClusterSpec(cpu_nodes=0, gpus_total=40, host_memory_mb=mb)
        )
        t0, c0 = time.perf_counter(), time.process_time()
        summary = Simulator(sc, get_policy("tangram-fast")).run().summary()
        wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        print(
            f"sim mopd batch 2048, host {'unbounded' if mb is None else f'{mb} MiB'} per node: wall {wall_s:.2f} s, cpu {cpu_s:.2f} s, "
            f"avg ACT {summary['avg_act_s']:.4f} s, loads {summary.get('loads_by_tier')}"
        )


if __name__ == "__main__":
    main()
