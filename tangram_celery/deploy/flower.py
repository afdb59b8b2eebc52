"""Flower, the Celery monitor, as the deployment (and `tangram flower`) starts it."""

from __future__ import annotations

import sys

from tangram_celery.common.config import TangramConfig


def pool_queues(cfg: TangramConfig) -> list[str]:
    """The Celery queue of every configured pool: tangram.cpu.*, tangram.gpu.*, tangram.api.*."""
    from tangram_celery.transport.app import queue_name

    gpu = [g.name for g in cfg.nodes.gpu if any(m.backend != "rule" for m in cfg.reward_models)]
    return (
        [queue_name("cpu", n.name) for n in cfg.nodes.cpu]
        + [queue_name("gpu", g) for g in gpu]
        + [queue_name("api", a.name) for a in cfg.apis]
    )


def flower_command(
    broker_url: str, port: int, address: str, auth: tuple[str, str], queues: list[str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Flower on `address`:`port` with basic auth always on: (argv, extra environment).

    The broker URL and the credentials go through the environment (Celery's BROKER_URL,
    Flower's FLOWER_BASIC_AUTH), so that no password shows in the process list. Flower runs
    with `tangram_celery.flower_app`, whose broker page lists `queues` (with their lengths)
    even before Flower has inspected the workers that consume them.
    """
    argv = [sys.executable, "-m", "celery", "-A", "tangram_celery.flower_app", "flower"]
    argv += [f"--port={port}", f"--address={address}"]
    env = {
        "TANGRAM_FLOWER_QUEUES": ",".join(queues or []),
        "BROKER_URL": broker_url,
        "FLOWER_BASIC_AUTH": f"{auth[0]}:{auth[1]}",
        "FLOWER_UNAUTHENTICATED_API": "",
        "FLOWER_INSPECT_TIMEOUT": "5000",  # ms; the 1 s default misses workers on a busy host
        # The args column shows each task's action kind and trajectory (the scheduler's argsrepr);
        # Flower 2.2 hides it by default. Search e.g. `args:trajectory=demo-3`.
        "FLOWER_TASKS_COLUMNS": "name,uuid,state,args,received,runtime,worker",
    }
    return argv, env
