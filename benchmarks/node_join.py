"""Node join latency, live: from a new node's registration to its first action (issue 39: <= 2 s).

Real processes: an embedded Redis, `tangram scheduler`, a worker for the one declared node `a`
(one core, kept busy by a long action so that the workload waits), and, for each join, a
`tangram worker cpu --node jN` for a node the config does not declare. Each round queues a few
short code actions, starts the new worker, and measures from its record's `registered_s`
(worker started, capacity detected) and `ready_s` (its Celery consumer takes messages) to the
first of those actions starting on it (the result's submit time + queue time, same host clock);
then SIGTERM drains it and the time to its exit is measured too.

Run: .venv/bin/python benchmarks/node_join.py [--joins 5] [--actions 4]
Writes benchmarks/results/node_join.json and .png.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, ROOT, percentile, write_json

SANDBOX = {"backend": "auto", "default_timeout_s": 30, "idle_ttl_s": 120}


def wait(what: str, cond: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.02)


def one_join(client: Any, store: Any, name: str, n_actions: int, spawn: Any) -> dict[str, Any]:
    """Queue `n_actions`, start node `name`'s worker, measure, then drain it."""
    from tangram_celery import CodeAction

    handles = [
        client.submit(CodeAction(trajectory_id=f"{name}-t{k}", code=f"print({k})", timeout_s=30))
        for k in range(n_actions)
    ]
    time.sleep(1.0)
    assert not any(h.done() for h in handles), "the workload must wait for the new node"
    started = time.time()
    proc = spawn(name)
    results = [h.result(timeout=180) for h in handles]
    rec = store.node_records()[name]
    mine = [r for r in results if r.node == name]
    assert mine, f"no action ran on {name}: {[r.node for r in results]}"
    first_s = min(submitted_s(store, r.action_id) + r.queue_s for r in mine)
    assert rec.ready_s is not None
    sigterm = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    return {
        "node": name,
        "spawn_to_register_s": rec.registered_s - started,
        "register_to_ready_s": rec.ready_s - rec.registered_s,
        "ready_to_first_action_s": first_s - rec.ready_s,
        "register_to_first_action_s": first_s - rec.registered_s,
        "actions_on_node": len(mine),
        "drain_exit_s": time.monotonic() - sigterm,
        "exit_code": proc.returncode,
        "load_avg_1m": os.getloadavg()[0],  # of the shared machine, at the end of the join
    }


def submitted_s(store: Any, action_id: str) -> float:
    """The action's submit time (epoch s, as its metadata says): its queue time counts from it."""
    from tangram_celery.common.wire import ActionMeta
    from tangram_celery.store import akey

    return ActionMeta.model_validate_json(store.r.hget(akey(action_id), "meta")).submitted_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--joins", type=int, default=5)
    ap.add_argument("--actions", type=int, default=4, help="short actions waiting at each join")
    args = ap.parse_args(argv)
    from tangram_celery import CodeAction, TangramClient
    from tangram_celery.store import Store
    from tangram_celery.transport.broker import EmbeddedRedis

    tmp = Path(tempfile.mkdtemp(prefix="node-join-"))
    cfg = {
        "state_dir": str(tmp / "state"),
        "nodes": {"cpu": [{"name": "a", "cores": 1, "memory_mb": 2048}]},
        "sandbox": SANDBOX,
    }
    config = tmp / "join.yaml"
    config.write_text(yaml.safe_dump(cfg))
    redis = EmbeddedRedis(tmp / "redis").start()
    env = dict(os.environ, TANGRAM_BROKER_URL=redis.url, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    cli = [sys.executable, "-m", "tangram_celery.cli"]
    procs: list[subprocess.Popen[bytes]] = []

    def start(log: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(tmp / f"{log}.log", "ab") as out:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        procs.append(p)
        return p

    def spawn(name: str) -> subprocess.Popen[bytes]:
        argv = [*cli, "worker", "cpu", "--node", name, "--cores", "1", "--memory-mb", "2048"]
        return start(f"worker-{name}", [*argv, "--config", str(config)])

    store = Store(redis.url)
    client = TangramClient(redis.url)
    joins: list[dict[str, Any]] = []
    try:
        start("scheduler", [*cli, "scheduler", "--config", str(config)])
        start("worker-a", [*cli, "worker", "cpu", "--node", "a", "--config", str(config)])
        wait("node a ready", lambda: (r := store.node_records().get("a")) and r.state == "ready", 120)
        blocker = client.submit(
            CodeAction(trajectory_id="blocker", code="import time\ntime.sleep(900)", timeout_s=900)
        )
        wait("the blocker running", lambda: store.action_state(blocker.id) == "running", 60)
        for i in range(1, args.joins + 1):
            joins.append(one_join(client, store, f"j{i}", args.actions, spawn))
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in joins[-1].items()}, flush=True)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        client.close()
        store.close()
        redis.stop()
    firsts = [j["register_to_first_action_s"] for j in joins]
    ready = [j["ready_to_first_action_s"] for j in joins]
    summary = {
        "joins": len(joins),
        "register_to_first_action_s": {"p50": percentile(firsts, 0.5), "max": max(firsts)},
        "ready_to_first_action_s": {"p50": percentile(ready, 0.5), "max": max(ready)},
        "target_s": 2.0,
        "met_p50": percentile(firsts, 0.5) <= 2.0,
        "met_max": max(firsts) <= 2.0,
        "joins_within_target": sum(1 for f in firsts if f <= 2.0),
    }
    print(summary)
    path = write_json("node_join", {"summary": summary, "joins": joins, "config": cfg})
    plot(joins, RESULTS / "node_join.png")
    print(f"wrote {path}")
    return 0


def plot(joins: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [j["node"] for j in joins]
    ready = [j["register_to_ready_s"] for j in joins]
    first = [j["ready_to_first_action_s"] for j in joins]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(names, ready, label="registered -> ready (Celery consumer up)")
    ax.bar(names, first, bottom=ready, label="ready -> first action started")
    ax.axhline(2.0, color="red", linestyle="--", linewidth=1, label="target 2 s")
    ax.set_ylabel("seconds")
    ax.set_title("A new node's registration to its first action")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
