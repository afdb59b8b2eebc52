"""A live many-node run: CPU worker hosts in network namespaces join and leave under load.

The run of `tests/integration/test_many_nodes.py` (`tests.fixtures.netns_scenario`), with its
figures kept: `--workers` declared nodes (each a `tangram worker cpu` in its own network
namespace, pinned to one host CPU, 1 core and 512 MiB lent), Redis and the scheduler on a
control host; mid-run `--joins` nodes the config does not declare join, `w1` is drained
(SIGTERM while it runs an action) and `w2` is lost (SIGKILL). Recorded: the nodes, the joins
and leaves, the actions submitted and completed, lost, completed twice and run twice (claims
Redis granted, read from MONITOR; only the lost node's may repeat), each joined node's time
from registering (its membership record's `registered_s`) to the start of its first action
(the scheduler's run log), the drain and loss times, and the wall time.

Needs root and iproute2 (network namespaces). Run:
    sudo .venv/bin/python benchmarks/many_nodes.py [--workers 8] [--joins 2] [--rounds 1]
Writes benchmarks/results/many_nodes.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_json
from tests.fixtures.netns_cluster import host_names, many_hosts, netns_problem
from tests.fixtures.netns_scenario import SANDBOX, Plan, run_many_nodes


def one_round(plan: Plan) -> dict[str, Any]:
    names = host_names(plan.workers, plan.joins)
    with tempfile.TemporaryDirectory(prefix="tangram-many-nodes-") as tmp, many_hosts(names) as hosts:
        out = run_many_nodes(hosts, Path(tmp), plan)
    fig = dict(out.figures)
    fig["ok"] = out.verdict.ok
    fig["events"] = out.events
    fig["problems"] = {k: v for k, v in out.verdict.summary().items() if isinstance(v, tuple) and v[0]}
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--workers", type=int, default=8, help="declared nodes (>= 3)")
    ap.add_argument("--joins", type=int, default=2, help="undeclared nodes that join mid-run")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--name", default="many_nodes")
    args = ap.parse_args()
    problem = netns_problem()
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    plan = Plan(workers=args.workers, joins=args.joins)
    rounds = [one_round(plan) for _ in range(args.rounds)]

    def joins(key: str) -> list[float]:
        return [j[key] for r in rounds for j in r["joins"].values() if j[key] is not None]

    firsts = joins("register_to_first_action_s")
    data: dict[str, Any] = {
        "plan": vars(plan),
        "sandbox": SANDBOX,
        "summary": {
            "nodes": plan.workers + plan.joins,
            "joins": plan.joins,
            "leaves": {"drained": 1, "lost": 1},
            "actions": sum(r["actions_completed"] for r in rounds),
            "lost": sum(r["lost_actions"] for r in rounds),
            "duplicates": sum(r["duplicates"] for r in rounds),
            "run_twice": sum(r["run_twice"] for r in rounds),
            "register_to_first_action_s": firsts,
            "register_to_first_action_max_s": max(firsts, default=None),
            "register_to_first_action_median_s": statistics.median(firsts) if firsts else None,
            # from the record's `ready` (its consumer takes messages): when the scheduler adds it
            "ready_to_first_action_s": joins("ready_to_first_action_s"),
            "process_start_to_first_action_s": joins("process_start_to_first_action_s"),
            "drain_sigterm_to_exit_s": [r["drain_sigterm_to_exit_s"] for r in rounds],
            "lost_detected_s": [r["lost_detected_s"] for r in rounds],
            "load_avg_note": "figures from a 2-core machine shared with other work: see provenance.load_avg",
            "wall_s": [r["wall_s"] for r in rounds],
            "all_ok": all(r["ok"] for r in rounds),
        },
        "rounds": rounds,
    }
    path = write_json(args.name, data)
    print(f"wrote {path}")
    print({k: v for k, v in data["summary"].items()})
    return 0 if data["summary"]["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
