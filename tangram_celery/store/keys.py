"""Redis keys, action states and the intake entry shape shared by every side of the store."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tangram_celery.common.tenants import DEFAULT, SEP, prefix

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
MEMORY = P + "memory"  # "<used_bytes> <maxmemory_bytes>" of Redis, published by the scheduler
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


def _key(kind: str, qualified: str) -> str:
    """`kind`'s key of the qualified id `<tenant>/<id>` (a bare id: the default tenant's), under
    its tenant's prefix (`tenants.prefix`)."""
    tenant, sep, local = qualified.partition(SEP)
    return f"{P}{kind}{qualified}" if not sep else f"{prefix(tenant)}{kind}{local}"


def akey(action_id: str) -> str:
    """The hash of the action with the qualified id `action_id`."""
    return _key("a:", action_id)


def nkey(action_id: str) -> str:
    """The result list of the action with the qualified id `action_id`."""
    return _key("n:", action_id)


def notify_key(client_id: str) -> str:
    """An asyncio client's notification list; `client_id` qualified by its tenant."""
    return _key("nq:", client_id)


def intake_key(tenant: str = DEFAULT) -> str:
    """`tenant`'s intake stream (the default tenant's is `INTAKE`)."""
    return prefix(tenant) + "intake"


def limits_key(tenant: str = DEFAULT) -> str:
    """`tenant`'s limits (hash, `max_queued`), written by the scheduler, read by its submits."""
    return prefix(tenant) + "limits"


def notify_prefix(tenant: str) -> str:
    """What every notification list of `tenant` starts with."""
    return prefix(tenant) + "nq:"


@dataclass(frozen=True)
class IntakeEntry:
    """One entry of a stream (intake or events): its id and fields, and the tenant whose intake
    it came on (`DEFAULT` for the events stream)."""

    stream_id: str
    fields: dict[str, str]
    tenant: str = DEFAULT

    @property
    def ref(self) -> str:
        """The entry as the scheduler's books keep it: its stream id, qualified by the tenant
        whose intake holds it (`entry_ref`; `Store.ack` and `mark_dispatched` take it)."""
        return entry_ref(self.tenant, self.stream_id)


def entry_ref(tenant: str, stream_id: str) -> str:
    """An intake entry's reference: `<tenant>/<stream id>` (the default tenant's: the bare id)."""
    return stream_id if tenant == DEFAULT else f"{tenant}{SEP}{stream_id}"


def split_ref(ref: str) -> tuple[str, str]:
    """(the intake stream, the stream id) of an entry's reference (`entry_ref`)."""
    tenant, sep, sid = ref.partition(SEP)
    return (intake_key(tenant), sid) if sep else (INTAKE, ref)


def redact(url: str) -> str:
    """The URL with its password hidden, for logs and errors."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
