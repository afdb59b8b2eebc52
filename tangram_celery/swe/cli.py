"""`tangram swe`: the SWE task images.

    tangram swe tasks                         the tasks: project, version, bug, hidden tests
    tangram swe build [--task NAME ...] [--docker-host URL] [--layout DIR] [--cache DIR]

`build` makes (or finds cached) the base root filesystem, the sdists and the repository layers,
writes the images into an OCI layout (default <cache>/oci; give it to the namespace backend as
`sandbox.images.oci_dirs`), and into the Docker engine at --docker-host when given.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tangram_celery.common.errors import TangramError
from tangram_celery.swe.build import build, cache_dir
from tangram_celery.swe.tasks import TASKS, task


def _tasks(_: argparse.Namespace) -> int:
    for t in TASKS:
        print(f"{t.image}: {t.project}=={t.version}, bug in {t.bug.path} ({t.function})")
        print(f"    issue: {t.issue}")
        print(f"    hidden tests: {' '.join(t.hidden_tests)}")
    return 0


def _build(args: argparse.Namespace) -> int:
    tasks = [task(n) for n in args.task] if args.task else list(TASKS)
    t0 = time.monotonic()
    built = build(
        tasks,
        cache=Path(args.cache) if args.cache else None,
        layout=Path(args.layout) if args.layout else None,
        docker_host=args.docker_host,
    )
    steps = ", ".join(f"{k} {v:.1f} s" for k, v in built.timings_s.items())
    print(f"swe: {len(tasks)} image(s) in {time.monotonic() - t0:.1f} s ({steps})")
    print(f"swe: OCI layout {built.layout} (sandbox.images.oci_dirs)")
    for ref, image_id in built.docker_images.items():
        print(f"swe: docker {ref} {image_id[:19]}")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="tangram swe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("tasks", help="list the tasks").set_defaults(fn=_tasks)
    b = sub.add_parser("build", help="build (or reuse cached) task images")
    b.add_argument(
        "--task", action="append", choices=[t.name for t in TASKS], help="only this task (repeatable)"
    )
    b.add_argument("--docker-host", help="also into this Docker engine (e.g. unix:///var/run/docker.sock)")
    b.add_argument("--layout", help="OCI layout directory (default: <cache>/oci)")
    b.add_argument("--cache", help=f"cache directory (default: {cache_dir()})")
    b.set_defaults(fn=_build)
    args = p.parse_args(argv)
    try:
        return int(args.fn(args))
    except (TangramError, ValueError) as e:
        print(f"tangram swe: {e}")
        return 2
