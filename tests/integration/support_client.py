"""A rollout-worker process for the client-crash test: submits, records ids, then waits forever."""

import sys
import time

from tangram_celery import ApiAction, TangramClient


def main(url: str, n: int, ids_path: str, log: str) -> None:
    client = TangramClient(url)
    handles = client.submit_many(
        ApiAction(trajectory_id=f"t{i % 4}", api="rec", request={"tag": i, "log": log, "sleep_s": 0.05})
        for i in range(n)
    )
    with open(ids_path, "w") as f:
        f.write("\n".join(h.id for h in handles))
    handles[0].result(timeout=60)
    time.sleep(3600)  # killed by the test while the rest is in flight


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
