"""Soak: mixed load for a long time with periodic random SIGKILLs; nothing may be lost or doubled.

Trajectories loop over a code action (real sandbox) and an API call (which appends its tag to a
log, so every execution is counted) while a killer SIGKILLs, at random, the scheduler, the CPU
worker, the API worker, or Redis (restarted from its AOF). At the end it prints actions
submitted, completed, lost (no result) and duplicated (API actions executed more than once),
and the drift of p99 ACT between the first and the last third of the run.

Run: .venv/bin/python benchmarks/soak.py --minutes 30 [--kill-every-s 60] [--trajectories 16]
Writes benchmarks/results/soak.json and soak.png.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, percentile, write_json
from tangram_celery import ActionResult, ApiAction, CodeAction, TangramClient
from tangram_celery.config import parse_config
from tangram_celery.deploy import Deployment, write_config
from tangram_celery.errors import TangramError


def config(tmp: Path) -> object:
    return parse_config(
        {
            "state_dir": str(tmp / "state"),
            "nodes": {"cpu": [{"name": "n0", "cores": 2, "memory_mb": 8192}]},
            "apis": [{"name": "rec", "handler": "tests.integration.support:record", "max_concurrency": 4}],
            "sandbox": {"backend": "auto", "idle_ttl_s": 30},
        }
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--kill-every-s", type=float, default=60.0)
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="tangram-soak-"))
    cfg = config(tmp)
    dep = Deployment(cfg, write_config(cfg, tmp / "soak.yaml"), with_flower=False)  # type: ignore[arg-type]
    dep.start()
    log = tmp / "executions.log"
    submitted: list[tuple[str, str]] = []  # (kind, action id)
    results: dict[str, ActionResult] = {}
    lock = threading.Lock()
    stop = threading.Event()
    kills: list[tuple[float, str]] = []
    t_start = time.monotonic()

    def trajectory(k: int) -> None:
        client = TangramClient(dep.url)
        step = 0
        while not stop.is_set():
            tid = f"soak-{k}-{step // 10}"  # a new trajectory every 10 steps
            if step % 2 == 0:
                action: CodeAction | ApiAction = CodeAction(
                    trajectory_id=tid,
                    code=f"print(sum(i * i for i in range({rng.randint(1, 200000)})))",
                    memory_mb=128,
                )
            else:
                action = ApiAction(
                    trajectory_id=tid, api="rec", request={"tag": f"{k}-{step}", "log": str(log)}
                )
            with lock:
                submitted.append((action.type, action.id))
            try:
                res = client.submit(action).result(timeout=600)
            except TangramError as e:
                print(f"  trajectory {k}: {e}", flush=True)
                break
            with lock:
                results[action.id] = res
            if step % 10 == 9:
                client.close_trajectory(tid)
            step += 1
            stop.wait(rng.uniform(0.0, 0.2))
        client.close()

    def killer() -> None:
        victims = ["scheduler", "worker-cpu-n0", "worker-api-rec", "redis"]
        while not stop.wait(args.kill_every_s * rng.uniform(0.5, 1.5)):
            v = rng.choice(victims)
            kills.append((time.monotonic() - t_start, v))
            print(f"  [{time.monotonic() - t_start:7.1f}s] SIGKILL {v}", flush=True)
            if v == "redis":
                assert dep.redis is not None
                dep.redis.kill()
                time.sleep(1.0)
                dep.redis.restart()
            else:
                dep.kill(v)

    threads = [threading.Thread(target=trajectory, args=(k,), daemon=True) for k in range(args.trajectories)]
    for t in threads:
        t.start()
    kt = threading.Thread(target=killer, daemon=True)
    kt.start()
    end = t_start + args.minutes * 60
    try:
        while time.monotonic() < end:
            time.sleep(min(30.0, max(0.1, end - time.monotonic())))
            with lock:
                print(
                    f"  [{time.monotonic() - t_start:7.1f}s] submitted {len(submitted)}, completed {len(results)}",
                    flush=True,
                )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=700)
        dep.stop()

    executed = Counter(line for line in log.read_text().split() if line) if log.exists() else Counter()
    api_ids = [
        (i, r) for i, r in results.items() if r.output and isinstance(r.output, dict) and "tag" in r.output
    ]
    lost = sum(1 for _, i in submitted if i not in results)
    duplicated = sum(1 for n in executed.values() if n > 1)
    ordered = sorted(results.values(), key=lambda r: r.act_s)  # for the overall p99
    by_time = [r for _, i in submitted if (r := results.get(i)) is not None]
    third = max(1, len(by_time) // 3)
    p99_first = percentile([r.act_s for r in by_time[:third]], 0.99)
    p99_last = percentile([r.act_s for r in by_time[-third:]], 0.99)
    statuses = Counter(str(r.status) for r in results.values())
    summary = {
        "policy": {"name": cfg.scheduler.policy, "params": {}},  # type: ignore[attr-defined]
        "minutes": args.minutes,
        "kills": kills,
        "submitted": len(submitted),
        "completed": len(results),
        "lost": lost,
        "duplicated": duplicated,
        "api_actions_checked": len(api_ids),
        "statuses": dict(statuses),
        "p99_act_s_first_third": p99_first,
        "p99_act_s_last_third": p99_last,
        "p99_drift": p99_last / p99_first if p99_first else None,
        "p99_act_s": percentile([r.act_s for r in ordered], 0.99) if ordered else None,
    }
    write_json("soak", summary)
    plot(by_time, kills, RESULTS / "soak.png")
    print(
        f"submitted {len(submitted)}, completed {len(results)}, lost {lost}, duplicated {duplicated}; "
        f"{len(kills)} kills; p99 ACT first third {p99_first:.2f}s, last third {p99_last:.2f}s "
        f"(drift x{summary['p99_drift'] or 0:.2f}); statuses {dict(statuses)}"
    )
    return 0 if lost == 0 and duplicated == 0 else 1


def plot(by_time: list[ActionResult], kills: list[tuple[float, str]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot(range(len(by_time)), [r.act_s for r in by_time], ".", ms=2, alpha=0.5)
    ax.set_yscale("log")
    ax.set_xlabel("action (submission order)")
    ax.set_ylabel("ACT (s)")
    ax.set_title(f"soak: {len(kills)} random SIGKILLs")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
