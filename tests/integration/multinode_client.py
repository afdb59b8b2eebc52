"""The client host of `test_multinode.py`, run inside its own network namespace.

    python -m tests.integration.multinode_client OUT.json PROGRESS.txt TRAJECTORIES TURNS

Each trajectory runs its turns one after the other (as an agent does): a code action that
sleeps a little and prints a value the test can check. Progress lines `<action_id> <node>` go to
PROGRESS as results arrive; the results go to OUT as JSON at the end. The broker URL comes from
TANGRAM_BROKER_URL.
"""

from __future__ import annotations

import json
import os
import sys
import threading

from tangram_celery import CodeAction, TangramClient


def main() -> int:
    out, progress, n_traj, turns = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    client = TangramClient(os.environ["TANGRAM_BROKER_URL"])
    results: list[dict[str, object]] = []
    lock = threading.Lock()
    prog = open(progress, "a", buffering=1)  # noqa: SIM115 - closed below

    def trajectory(t: int) -> None:
        tid = f"t{t}"
        for k in range(turns):
            value = t * 1000 + k
            action = CodeAction(
                trajectory_id=tid, code=f"import time\ntime.sleep(0.3)\nprint({value} * 2)", timeout_s=30
            )
            res = client.submit(action).result(timeout=600)
            with lock:
                results.append({"expected": str(value * 2), **res.model_dump(mode="json")})
                prog.write(f"{res.action_id} {res.node} {res.status}\n")
        client.close_trajectory(tid)

    threads = [threading.Thread(target=trajectory, args=(t,)) for t in range(n_traj)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    prog.close()
    client.close()
    with open(out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
