"""Redis users: one per role of a deployment and one per tenant, each with only the keys,
channels and commands it needs (issue 37). No I/O here but `main` (the `render` command).

Roles (`ROLES`): `admin` (the operator and the `tangram` CLI: everything), `scheduler`,
`worker-cpu`, `worker-gpu`, `worker-api`, `http` (acts for every tenant, no Celery) and `flower`
(Celery's events, queues and remote-control inspect). The `default` user is off. A tenant's user
`tenant-<name>` (`tenant_rules`) reaches its own work under `tenants.prefix(name)` and reads the
few shared keys its client needs; no Celery key, no channel, no admin command.

Celery's Redis transport (kombu 5.7, `transport.app`'s settings: db 0, `fanout_prefix` and
`fanout_patterns` on) uses these keys and channels, and no other:

- a queue is a list named after it, `tangram.<kind>.<pool>` (and `tangram.default`); priority
  steps add a suffix to the name (`<queue>\\x06\\x16<n>`): `tangram.*`;
- bindings: `_kombu.binding.<exchange>`, `_kombu.binding_permanent.<exchange>`,
  `_kombu.binding_deadlines`: `_kombu.binding*`;
- an event receiver's queue (Flower's) `celeryev.<uuid>`, which kombu declares and sizes;
- late acks: `unacked` (hash), `unacked_index` (sorted set), `unacked_mutex`;
- remote control: a worker's pidbox queue `<host>.celery.pidbox` and reply queues
  `<oid>.reply.celery.pidbox` (lists, with the priority suffix too): `*.celery.pidbox*`; broadcasts go on the channel
  `/0.celery.pidbox`;
- task events (for Flower) on the channels `/0.celeryev/<type>` (Flower PSUBSCRIBEs
  `/0.celeryev/*`, and a PSUBSCRIBE is allowed only by an identical channel pattern);
- no result keys: every task is `ignore_result` (`workers.tasks`, `scheduler.service.sender`).

Roles other than `admin` keep Redis's command set minus `@admin` and `@dangerous` (no CONFIG,
FLUSHALL, SHUTDOWN, DEBUG, MONITOR, KEYS, CLIENT KILL...) and minus FUNCTION and SCRIPT FLUSH/
KILL, with INFO added back where a role reads memory; their keys are what bounds them. Tenants
get an explicit list: the commands Tangram's clients send (`store.client_ops`).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from tangram_celery.common import tenants
from tangram_celery.store import keys
from tangram_celery.transport.private_file import write_private

ADMIN = "admin"
ROLES = ("admin", "scheduler", "worker-cpu", "worker-gpu", "worker-api", "http", "flower")
WORKER_ROLES = ("worker-cpu", "worker-gpu", "worker-api")

CELERY_KEYS = (
    "tangram.*",
    "celeryev.*",
    "_kombu.binding*",
    "unacked",
    "unacked_index",
    "unacked_mutex",
    "*.celery.pidbox*",
)


def events_channel(db: int = 0) -> str:
    return f"/{db}.celeryev/*"


def pidbox_channel(db: int = 0) -> str:
    return f"/{db}.celery.pidbox"


# Shared keys a tenant's client reads (and nothing else of the deployment's)
TENANT_READABLE = (keys.CONFIG, keys.LANGS, keys.IMAGES, keys.P + "memory")
# What every worker kind writes or reads besides actions, results and notify lists
_WORKER_KEYS = (
    keys.EVENTS,
    keys.WORKERS,
    keys.WORKER_POOLS,
    keys.SANDBOXES,
    keys.WARM,
    keys.LANGS,
    keys.IMAGES,
    keys.NODES,
    keys.NODE_LOAD,
    keys.RESETS,
)
_WORKER_READS = (keys.CONFIG, keys.RUNNING, keys.TRAJ, keys.P + "memory")
_ANY_TENANT = "tangram:t:*:"  # every named tenant's prefix (names hold no glob character)

# redis-py's connection set-up, pipelines (MULTI/EXEC) and scripts by digest (EVALSHA). Not
# CLIENT SETINFO: Redis 7.0 has none (redis-py ignores its refusal)
_CLIENT_COMMANDS = [
    "+ping",
    "+hello",
    "+auth",
    "+select",
    "+echo",
    "+quit",
    "+reset",
    "+client|setname",
    "+client|getname",
    "+client|id",
    "+multi",
    "+exec",
    "+discard",
    "+watch",
    "+unwatch",
    # EVALSHA only: a tenant runs the scripts the scheduler loaded (`client_ops.CLIENT_SCRIPTS`),
    # never EVAL or SCRIPT LOAD of its own: a script can run for ever, and Redis then answers
    # BUSY to every client until an admin kills it
    "+evalsha",
    "+script|exists",
]
# what Tangram's client sends on its own keys (`store.client_ops`, `store.client_aio`)
_TENANT_COMMANDS = [
    "+hget",
    "+hmget",
    "+hgetall",
    "+hexists",
    "+get",
    "+exists",
    "+blpop",
    "+lpop",
    "+del",
    "+expire",
    "+xadd",
    "+xlen",
    *("+hset", "+hdel", "+rpush", "+xack", "+xdel"),  # what the submit and cancel scripts run
]
_INTERNAL_COMMANDS = ["+@all", "-@admin", "-@dangerous", "-function", "-script|flush", "-script|kill"]


def _work_patterns(prefix: str) -> list[str]:
    """Read-write patterns of one tenant's work (or, with `_ANY_TENANT`, every named tenant's):
    its intake, actions, results and notify lists; its `limits` stay out (read-only)."""
    return [f"~{prefix}{k}" for k in ("intake", "a:*", "n:*", "nq:*")]


def _all_work() -> list[str]:
    """Every tenant's work: the default tenant's (`tangram:`) and the named ones'."""
    return _work_patterns(tenants.prefix(tenants.DEFAULT)) + _work_patterns(_ANY_TENANT)


def _celery(role: str, db: int) -> list[str]:
    """Celery's keys for every Celery role; its channels by what the role does with them."""
    rules = [f"~{k}" for k in CELERY_KEYS]
    rules += [f"&{events_channel(db)}", f"&{pidbox_channel(db)}"]
    return rules


def role_rules(role: str, db: int = 0) -> list[str]:
    """ACL SETUSER rule tokens of `role` (without its name, password and on/off; see
    `setuser_args`). `db`: the Redis database the deployment's URLs name (Celery's channel
    names carry it)."""
    if role == ADMIN:
        return ["~*", "&*", "+@all"]
    if role == "scheduler":
        rules = ["~tangram:*", *_celery(role, db)]
        return [*rules, *_INTERNAL_COMMANDS, "+info"]
    if role in WORKER_ROLES:
        rules = _all_work() + [f"~{k}" for k in _WORKER_KEYS] + [f"%R~{k}" for k in _WORKER_READS]
        return [*rules, *_celery(role, db), *_INTERNAL_COMMANDS]
    if role == "http":
        rules = _all_work() + [f"%R~{k}" for k in (*TENANT_READABLE, tenants.REGISTRY)]
        rules += [f"%R~{tenants.prefix(tenants.DEFAULT)}limits", f"%R~{_ANY_TENANT}limits"]
        return [*rules, *_INTERNAL_COMMANDS, "-@pubsub", "+info"]
    if role == "flower":
        rules = [*_celery(role, db), f"%R~{keys.WORKERS}", f"%R~{keys.WORKER_POOLS}"]
        return [*rules, *_INTERNAL_COMMANDS, "+info"]
    raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")


def tenant_rules(tenant: str) -> list[str]:
    """ACL SETUSER rule tokens of `tenant`'s user (`tenants.redis_user`): read-write on its own
    work, read-only on its `limits` and on `TENANT_READABLE`; no channel; only the commands its
    client sends."""
    prefix = tenants.prefix(tenants.valid_name(tenant))
    rules = [*_work_patterns(prefix), f"%R~{prefix}limits", *(f"%R~{k}" for k in TENANT_READABLE)]
    return [*rules, "resetchannels", "-@all", *_CLIENT_COMMANDS, *_TENANT_COMMANDS]


# The default user is off and has no password: no client can authenticate as it, and a client
# that has not authenticated runs nothing but AUTH and HELLO. Its permissions are still all:
# Redis 7.0 replays the AOF as `default`, and refuses a MULTI/EXEC there (a script's writes are
# logged as one: every SUBMIT) that `default` may not run, dropping it with "NOPERM ACLs rules
# changed" in its log: a restart would lose every action. (7.2 replays as no user.)
DEFAULT_USER = "user default off resetpass ~* &* +@all"


def password_digest(password: str) -> str:
    """`#<sha256>`: how a password is given to ACL SETUSER and kept in an aclfile."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def setuser_args(user: str, password: str, rules: list[str]) -> list[str]:
    """The arguments of `ACL SETUSER` that make `user` exactly this (any earlier rules and
    passwords dropped): `r.execute_command("ACL", "SETUSER", *setuser_args(...))`."""
    return [user, "reset", "on", password_digest(password), "resetkeys", "resetchannels", *rules]


def acl_file(passwords: dict[str, str], db: int = 0) -> str:
    """An aclfile with every role's user (`passwords`: role -> password; every role needs one)
    and the default user off."""
    missing = [r for r in ROLES if not passwords.get(r)]
    if missing:
        raise ValueError(f"no password for role(s) {', '.join(missing)}")
    lines = [DEFAULT_USER]
    for role in ROLES:
        rules = ["on", password_digest(passwords[role]), "resetkeys", "resetchannels", *role_rules(role, db)]
        lines.append(f"user {role} {' '.join(rules)}")
    return "\n".join(lines) + "\n"


def merge_acl_file(passwords: dict[str, str], existing: str = "", db: int = 0) -> str:
    """`acl_file(passwords)` followed by every user of the `existing` aclfile that is neither a
    role nor `default` (the tenants `tangram tenant` saved there)."""
    ours = {"default", *ROLES}
    kept = []
    for line in existing.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "user" and words[1] not in ours:
            kept.append(line + "\n")
    return acl_file(passwords, db) + "".join(kept)


def env_name(role: str) -> str:
    """The environment variable compose gives a role's password in: TANGRAM_REDIS_PASSWORD_<ROLE>."""
    return "TANGRAM_REDIS_PASSWORD_" + role.upper().replace("-", "_")


def main(argv: list[str]) -> int:
    """`python -m tangram_celery.transport.acl render [--out FILE]`: the aclfile, each role's
    password from `env_name(role)`, on stdout or into FILE (0600), where the users of FILE's
    earlier version that are not roles (tenants) are kept: compose's `redis-users` service."""
    if argv[:1] != ["render"] or not (len(argv) == 1 or (len(argv) == 3 and argv[1] == "--out")):
        print("usage: python -m tangram_celery.transport.acl render [--out FILE]", file=sys.stderr)
        return 2
    out = argv[2] if len(argv) == 3 else None
    try:
        existing = Path(out).read_text() if out and os.path.exists(out) else ""
        text = merge_acl_file({r: os.environ.get(env_name(r), "") for r in ROLES}, existing)
    except ValueError as e:
        print(f"acl render: {e} (set {', '.join(env_name(r) for r in ROLES)})", file=sys.stderr)
        return 1
    if out is None:
        sys.stdout.write(text)
        return 0
    write_private(out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
