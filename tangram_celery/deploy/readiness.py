"""When a deployment is ready: every worker answers, and the GPU workers' reward services are warm."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis

from tangram_celery.common.config import TangramConfig
from tangram_celery.common.errors import TangramError
from tangram_celery.common.records import WarmStatus
from tangram_celery.store import Store

log = logging.getLogger("tangram.deploy")


def gpu_worker_nodes(cfg: TangramConfig) -> list[str]:
    """GPU nodes that get a worker (and Triton): those of a config with Triton-served models."""
    if not any(m.backend != "rule" for m in cfg.reward_models):
        return []
    return [g.name for g in cfg.nodes.gpu]


def warm_nodes(cfg: TangramConfig) -> list[str]:
    """GPU nodes whose worker warms the reward services at start (`nodes.gpu[].warm_up`)."""
    gpu = set(gpu_worker_nodes(cfg))
    return [g.name for g in cfg.nodes.gpu if g.name in gpu and g.warm_up]


def wait_ready(
    url: str,
    expected: set[str],
    check_alive: Callable[[], None],
    logs_dir: Path,
    timeout_s: float = 60.0,
    progress: bool = True,
) -> None:
    """Wait until the scheduler published its pools and every worker of `expected` (their
    names without the host) answers a ping; `check_alive` raises when a child died."""
    store = Store(url)
    deadline = time.monotonic() + timeout_s
    from tangram_celery.transport.app import make_app

    app = make_app(url)
    seen: set[str] = set()
    while time.monotonic() < deadline:
        check_alive()
        if store.pool_view() is not None:
            try:
                replies = app.control.ping(timeout=0.5) or []
            except (OSError, redis.RedisError):  # a pooled connection to an earlier server
                replies = []  # of this URL (a stack restarted in this process): once more
            seen = {name.split("@")[0] for r in replies for name in r}
            if expected <= seen:
                if progress:
                    print(f"ready: scheduler + {len(seen)} worker(s)")
                store.close()
                return
        time.sleep(0.2)
    store.close()
    raise TangramError(
        f"deployment not ready in {timeout_s}s; workers seen: {sorted(seen)}, "
        f"expected {sorted(expected)}; logs in {logs_dir}"
    )


def wait_warm(
    url: str, nodes: list[str], timeout_s: float = 300.0, stop: threading.Event | None = None
) -> dict[str, WarmStatus]:
    """Block until the GPU workers of `nodes` finished warming their services; node -> warm-up
    status (`loaded` replicas, `failed` ones, `seconds`). Raises TangramError on timeout."""
    store = Store(url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            status = store.warm_status()
            if all(n in status and status[n].state == "done" for n in nodes):
                return {n: status[n] for n in nodes}
            if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                raise TangramError(f"reward services not warm after {timeout_s:.0f} s: {status}")
            time.sleep(0.25)
    finally:
        store.close()


def announce_warm_up(
    cfg: TangramConfig, url: str, stop: threading.Event, say: Callable[[str], object]
) -> None:
    """Say which reward services warm where, then, from a background thread, when they are warm."""
    warm = warm_nodes(cfg)
    if not warm:
        return
    services = [m.name for m in cfg.reward_models if m.backend != "rule"]
    say(
        f"warming {len(services)} reward service(s) ({', '.join(services)}) on GPU node(s) "
        f"{', '.join(warm)} in the background"
    )
    threading.Thread(
        target=_report_warm_up, args=(url, warm, stop, say), name="tangram-warm-up", daemon=True
    ).start()


def _report_warm_up(url: str, nodes: list[str], stop: threading.Event, say: Callable[[str], object]) -> None:
    try:
        status = wait_warm(url, nodes, stop=stop)
    except Exception as e:  # the deployment stopped, or warming is slow: requests load on demand
        log.info("warm-up not reported: %s", e)
        return
    for node, st in sorted(status.items()):
        loaded, failed = st.loaded, st.failed
        line = f"reward services warm on {node}: {len(loaded)} replica(s) in {st.seconds:.1f} s"
        if failed:
            line += f"; failed: {', '.join(failed)} (they load on demand; see the worker's log)"
        say(line)
