"""Removes a Docker worker's containers once the worker is gone, however it ended.

Containers are children of the Docker engine, not of the worker, so no parent-death signal
reaches them. `DockerSandbox` starts this process in its own session with the read end of a pipe
whose write end only the worker holds; end of file on it means the worker exited (cleanly,
by SIGKILL, or because its own parent died). It then removes every container carrying all the
given labels (the worker's scope and incarnation: nobody else's) and exits.

    python -m tangram_celery.sandbox.reaper --fd FD --url URL --label K=V [--label K=V ...]
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import time


def wait_for_eof(fd: int) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLHUP)
    while True:
        for _, ev in p.poll():
            if ev & (select.POLLHUP | select.POLLERR):
                return
            if ev & select.POLLIN and not os.read(fd, 4096):
                return


def remove_labelled(url: str, labels: list[str], attempts: int = 5) -> int:
    """Remove the containers that carry every label in `labels`; returns how many."""
    import docker

    for attempt in range(attempts):
        try:
            client = docker.DockerClient(base_url=url, timeout=30) if url else docker.from_env(timeout=30)
            try:
                found = client.containers.list(all=True, filters={"label": labels})
                for c in found:
                    c.remove(force=True)
                return len(found)
            finally:
                client.close()
        except Exception as e:  # the engine may be restarting: try again a few times
            print(f"reaper: attempt {attempt + 1}: {e}", file=sys.stderr, flush=True)
            time.sleep(1.0 + attempt)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tangram-sandbox-reaper")
    ap.add_argument("--fd", type=int, required=True, help="read end of the worker's lifeline pipe")
    ap.add_argument("--url", default="", help="Docker engine URL (empty: DOCKER_HOST / default)")
    ap.add_argument("--label", action="append", required=True, help="KEY=VALUE every container carries")
    args = ap.parse_args(argv)
    wait_for_eof(args.fd)
    n = remove_labelled(args.url, args.label)
    if n:
        print(f"reaper: removed {n} container(s) of {args.label}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
