"""Redis keys, action states and the intake entry shape shared by every side of the store."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

P = "tangram:"
INTAKE = P + "intake"
EVENTS = P + "events"
RUNNING = P + "running"
TRAJ = P + "traj"
CONFIG = P + "config"
DEAD = P + "dead"  # dead-letter stream: malformed intake entries, with the reason
DEAD_MAXLEN = 10_000
WORKERS = P + "workers"  # worker name -> last heartbeat (Redis server time, s)
WORKER_POOLS = P + "worker_pools"  # worker name -> pool key "cpu:n0" / "api:calc" / "gpu:g0"
SANDBOXES = P + "sandboxes"  # CPU worker name -> JSON {"seq", "held": [[trajectory, generation]]}
RESETS = P + "reset"  # trajectory -> when its sandbox was lost (its next result says so)
WARM = P + "warm"  # GPU node -> warm-up status (JSON)
LANGS = P + "languages"  # CPU node -> JSON list of the languages its sandboxes run
# CPU node -> JSON {"held": [[ref, bytes], ...], "fetchable": [ref, ...], "layers": [trajectory, ...]}
IMAGES = P + "images"
NODES = P + "nodes"  # node -> its membership record (`common.node_record.NodeRecord`, JSON)
NODE_LOAD = P + "node_load"  # node -> its load as the scheduler sees it (`NodeLoad`, JSON)
GROUP = "sched"
CONSUMER = "scheduler"
RESULT_TTL_S = 24 * 3600
# A result its caller has read is kept this much longer only (a re-read, a second handle),
# not a day: broker memory then follows the rate of results times minutes. At 100 results a
# second a day of them (about 2 KB each) would be some 17 GB, far past `broker.maxmemory_mb`.
READ_TTL_S = 600


class ActionState(StrEnum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


def akey(action_id: str) -> str:
    return f"{P}a:{action_id}"


def nkey(action_id: str) -> str:
    return f"{P}n:{action_id}"


def notify_key(client_id: str) -> str:
    return f"{P}nq:{client_id}"


@dataclass(frozen=True)
class IntakeEntry:
    """One entry of a stream (intake or events): its id and fields."""

    stream_id: str
    fields: dict[str, str]


def redact(url: str) -> str:
    """The URL with its password hidden, for logs and errors."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
