"""Removes a CPU worker's sandboxes once the worker is gone, however it ended.

Docker containers are children of the engine, not of the worker, so no parent-death signal
reaches them; namespace runners die with the worker (lifeline), but their cgroups and the
worker's stage directory stay behind. Each backend therefore starts this process in its own
session with the read end of a pipe whose write end only the worker holds. End of file on it
means the worker exited (cleanly, by SIGKILL, or because its own parent died); the reaper then
removes what belongs to that worker incarnation and nothing else: containers carrying all the
given labels (scope and incarnation), cgroups named with the incarnation's prefix, and the
incarnation's stage directory, and with sandbox.network its egress router, sandbox network
namespaces and uplink rules (`egress.sweep`). Then it exits.

    python -m tangram_celery.sandbox.reaper --fd FD --stage DIR [--cgroup-prefix P]
        [--docker-url URL --label K=V [--label K=V ...]] [--egress SCOPE/INC [--uplink NETNS]]
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def wait_for_eof(fd: int) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLHUP)
    while True:
        for _, ev in p.poll():
            if ev & (select.POLLHUP | select.POLLERR):
                return
            if ev & select.POLLIN and not os.read(fd, 4096):
                return


def remove_containers(url: str, labels: list[str], attempts: int = 5) -> int:
    """Remove the containers that carry every label in `labels`; returns how many."""
    import docker

    for attempt in range(attempts):
        try:
            client = docker.DockerClient(base_url=url, timeout=30) if url else docker.from_env(timeout=30)
            try:
                found = client.containers.list(all=True, ignore_removed=True, filters={"label": labels})
                for c in found:
                    c.remove(force=True)
                return len(found)
            finally:
                client.close()
        except Exception as e:  # the engine may be restarting: try again a few times
            print(f"reaper: attempt {attempt + 1}: {e}", file=sys.stderr, flush=True)
            time.sleep(1.0 + attempt)
    return 0


def remove_cgroups(prefix: str) -> int:
    """Kill what is left in the cgroups named `prefix*` and remove them; returns how many."""
    from tangram_celery.sandbox.cgroups import CgroupSet, children

    n = 0
    for name in children(prefix):
        cg = CgroupSet.existing(name)
        if cg is not None:
            cg.destroy()
            n += 1
    return n


def remove_stage(stage_dir: Path) -> None:
    """The incarnation's directory and lock file (its scope directory too when empty)."""
    from tangram_celery.sandbox.mounts import unmount_under

    unmount_under(stage_dir)  # trajectories' layers (tmpfs) first
    shutil.rmtree(stage_dir, ignore_errors=True)
    (stage_dir.parent / f"{stage_dir.name}.lock").unlink(missing_ok=True)
    try:
        stage_dir.parent.rmdir()
    except OSError:
        pass


class Reaper:
    """The worker's handle on its reaper process: `close()` after a clean shutdown."""

    def __init__(
        self,
        stage_dir: Path,
        cgroup_prefix: str | None = None,
        docker_url: str | None = None,
        labels: tuple[str, ...] = (),
        egress: Any = None,
        uplink: str | None = None,
    ) -> None:
        """`egress`: the worker's `SandboxScope` when its sandboxes have network (`uplink`:
        sandbox.egress_uplink)."""
        r, self._w = os.pipe2(os.O_CLOEXEC)
        argv = [
            sys.executable,
            "-m",
            "tangram_celery.sandbox.reaper",
            "--fd",
            str(r),
            "--stage",
            str(stage_dir),
        ]
        if cgroup_prefix:
            argv += ["--cgroup-prefix", cgroup_prefix]
        if docker_url is not None:
            argv += ["--docker-url", docker_url]
            for label in labels:
                argv += ["--label", label]
        if egress is not None:
            argv += [
                "--egress",
                f"{egress.scope}/{egress.incarnation}",
                *(["--uplink", uplink] if uplink else []),
            ]
        try:  # its own session and no parent-death signal: it must outlive the worker; it
            # writes to the worker's stderr (the worker's log)
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(r,),
                start_new_session=True,
            )
        finally:
            os.close(r)

    def close(self, timeout_s: float = 30.0) -> None:
        """Let the reaper run now (the worker has removed everything itself) and wait for it."""
        if self._w >= 0:
            os.close(self._w)
            self._w = -1
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tangram-sandbox-reaper")
    ap.add_argument("--fd", type=int, required=True, help="read end of the worker's lifeline pipe")
    ap.add_argument("--stage", required=True, help="the worker incarnation's stage directory")
    ap.add_argument("--cgroup-prefix", default="", help="name prefix of the incarnation's cgroups")
    ap.add_argument("--docker-url", default=None, help="Docker engine URL (empty: DOCKER_HOST / default)")
    ap.add_argument("--label", action="append", default=[], help="KEY=VALUE every container carries")
    ap.add_argument("--egress", default="", help="SCOPE/INCARNATION whose egress router to remove")
    ap.add_argument("--uplink", default=None, help="the named netns holding its uplink rules")
    args = ap.parse_args(argv)
    wait_for_eof(args.fd)
    containers = cgroups = 0
    if args.docker_url is not None and args.label:
        containers = remove_containers(args.docker_url, args.label)
    if args.cgroup_prefix:
        cgroups = remove_cgroups(args.cgroup_prefix)
    remove_stage(Path(args.stage))
    if args.egress:
        from tangram_celery.sandbox.egress import sweep

        scope, _, inc = args.egress.partition("/")
        sweep(scope, args.uplink, lambda i: i != inc)
    if containers or cgroups:  # a clean shutdown leaves nothing: then say nothing
        print(f"reaper: worker gone; removed {containers} container(s), {cgroups} cgroup(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
