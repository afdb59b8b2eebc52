"""`tangram tenant add|list|remove|rotate`: the operator's commands for tenants (issue 37).

They run with the operator's (admin) broker URL, found as every other command finds it
(`<state_dir>/broker.url` of the embedded broker, or `broker.url` in the config). A tenant is
two things: a Redis user `tenant-<name>` whose ACL rules (`transport.acl.tenant_rules`) reach
only its own keys, and a record in the registry (`store.tenant_side`) with its quotas and the
SHA-256 of its HTTP token. `add` and `rotate` print the secrets once; Redis keeps only the
password's hash and the registry only the token's digest, so they cannot be shown again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import ValidationError

from tangram_celery.common.errors import TangramError
from tangram_celery.common.tenants import Quotas, TenantRecord, prefix, redis_user, valid_name

if TYPE_CHECKING:
    import redis

    from tangram_celery.store import Store

ACTIVE_STATES = ("queued", "dispatched", "running")
_UNKNOWN_RULE = re.compile(r"modifier '(\+[^']+)': Unknown command")


# ---- pure: arguments, secrets, URLs, printing ------------------------------------------------
def api_shares(items: list[str]) -> dict[str, float]:
    """`API=FRACTION` arguments as a dict (a fraction in (0, 1]); ValueError saying what is wrong."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if not sep or not name or not 0.0 < share <= 1.0:
            raise ValueError(f"bad --api-share {item!r}: API=FRACTION with 0 < FRACTION <= 1, e.g. calc=0.5")
        out[name] = share
    return out


def quotas_of(args: argparse.Namespace) -> Quotas:
    try:
        shares = api_shares(args.api_share or [])
    except ValueError as e:
        raise TangramError(str(e)) from None
    try:
        return Quotas(
            max_queued=args.max_queued,
            max_cores=args.max_cores,
            max_memory_mb=args.max_memory_mb,
            max_gpu_memory_mb=args.max_gpu_memory_mb,
            api_share=shares,
            priority=args.priority,
        )
    except ValidationError as e:
        raise TangramError(f"bad quotas: {e}") from None


def new_password() -> str:
    return secrets.token_hex(24)  # URL-safe as is: no quoting surprises in a client URL


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    """The registry's form of an HTTP token (what `web.auth.digest` compares)."""
    return hashlib.sha256(token.encode()).hexdigest()


def client_url(admin_url: str, user: str, password: str) -> str:
    """The broker URL with `user`:`password` in place of the operator's credentials: same
    scheme, host, port, database and query (TLS settings)."""
    parts = urlsplit(admin_url)
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


@dataclass(frozen=True)
class Secrets:
    """What `add` / `rotate` hand out once: the client URL and/or the HTTP token."""

    name: str
    client_url: str | None = None
    http_token: str | None = None


def show_secrets(s: Secrets, verb: str, as_json: bool, quotas: Quotas | None = None) -> str:
    if as_json:
        out: dict[str, Any] = {"name": s.name}
        if s.client_url is not None:
            out["client_url"] = s.client_url
        if s.http_token is not None:
            out["http_token"] = s.http_token
        if quotas is not None:
            out["quotas"] = quotas.model_dump(mode="json")
        return json.dumps(out, indent=2)
    lines = [f"tenant {s.name} {verb}"]
    if s.client_url is not None:
        lines.append(f"  client URL (TangramClient(broker_url=...)): {s.client_url}")
    if s.http_token is not None:
        lines.append(f"  HTTP token (Authorization: Bearer ...):     {s.http_token}")
    lines.append("shown once: Redis keeps only the password's hash, Tangram only the token's SHA-256")
    return "\n".join(lines)


def _quota_text(q: Quotas) -> list[str]:
    shares = ",".join(f"{k}={v:g}" for k, v in sorted(q.api_share.items())) or "-"
    return [
        q.priority,
        str(q.max_queued or "-"),
        str(q.max_cores or "-"),
        str(q.max_memory_mb or "-"),
        str(q.max_gpu_memory_mb or "-"),
        shares,
    ]


def show_list(records: dict[str, TenantRecord], users: set[str], as_json: bool) -> str:
    """The registry as a table or JSON: names, quotas, whether a token is set and the Redis user
    exists, when made. Never a secret (there is none to show: only digests are kept)."""
    rows = [records[n] for n in sorted(records)]
    if as_json:
        return json.dumps(
            [
                {
                    "name": r.name,
                    "quotas": r.quotas.model_dump(mode="json"),
                    "token_set": bool(r.token_sha256),
                    "redis_user": redis_user(r.name) in users,
                    "created_s": r.created_s,
                }
                for r in rows
            ],
            indent=2,
        )
    if not rows:
        return "no tenants (add one with `tangram tenant add NAME`)"
    head = ["NAME", "PRIORITY", "MAX_QUEUED", "CORES", "MEMORY_MB", "GPU_MB", "API_SHARE", "TOKEN", "USER"]
    table = [head]
    for r in rows:
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.created_s)) if r.created_s else "-"
        user = "yes" if redis_user(r.name) in users else "MISSING"
        table.append([r.name, *_quota_text(r.quotas), "yes" if r.token_sha256 else "no", user, created])
    head.append("CREATED")
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    )


# ---- Redis: the operator's side ------------------------------------------------------------
def set_user(r: redis.Redis, name: str, password: str) -> None:
    """Make `name`'s Redis user exactly its rules (`transport.acl.tenant_rules`) with `password`
    (sent as its SHA-256 only), replacing whatever rules and passwords it had."""
    import redis as redis_mod

    from tangram_celery.transport.acl import setuser_args, tenant_rules

    args = setuser_args(redis_user(name), password, tenant_rules(name))
    while True:
        try:
            r.execute_command("ACL", "SETUSER", *args)
            return
        except redis_mod.ResponseError as e:
            # a command this Redis does not have (CLIENT SETINFO is 7.2's): nothing to allow
            m = _UNKNOWN_RULE.search(str(e))
            if m is None or m.group(1) not in args[1:]:
                raise
            args = [a for a in args if a != m.group(1)]


def acl_save(r: redis.Redis) -> str | None:
    """ACL SAVE; a note (not an error) when this Redis has no aclfile (an external one)."""
    import redis as redis_mod

    try:
        r.execute_command("ACL", "SAVE")
    except redis_mod.ResponseError as e:
        if "acl file" in str(e).lower() or "aclfile" in str(e).lower():
            return (
                "note: this Redis has no aclfile, so the change is not saved across a Redis restart "
                "(save it with CONFIG REWRITE, or configure an aclfile)"
            )
        raise
    return None


def kill_connections(r: redis.Redis, user: str) -> int:
    """Close every connection `user` holds (a changed password or a removed user acts at once)."""
    import redis as redis_mod

    try:
        return int(r.execute_command("CLIENT", "KILL", "USER", user))
    except redis_mod.ResponseError:  # no such user: nothing to close
        return 0


def redis_users(r: redis.Redis) -> set[str]:
    return {str(u) for u in r.execute_command("ACL", "USERS")}


def busy(r: redis.Redis, name: str) -> str | None:
    """Why `name` has work queued or running (its intake's length, the scheduler's running
    entries of its qualified ids, its action hashes' states), or None."""
    p = prefix(name)
    waiting = int(r.xlen(p + "intake"))
    if waiting:
        return f"{waiting} entries wait in its intake"
    running = sum(1 for _ in r.hscan_iter("tangram:running", match=f"{name}/*"))
    if running:
        return f"{running} of its actions are running"
    for key in r.scan_iter(match=p + "a:*", count=1000):
        state = r.hget(key, "state")
        if state in ACTIVE_STATES:
            return f"action {str(key)[len(p) + 2 :]} is {state}"
    return None


@dataclass
class Admin:
    """The operator's connection: the registry and the ACL users."""

    url: str
    store: Store

    @property
    def r(self) -> redis.Redis:
        return self.store.r

    def record(self, name: str) -> TenantRecord | None:
        return self.store.tenants().get(name)

    def add(self, name: str, quotas: Quotas) -> tuple[Secrets, str | None]:
        user = redis_user(valid_name(name))
        if self.record(name) is not None:
            raise TangramError(f"tenant {name!r} exists (see `tangram tenant list`)")
        if user in redis_users(self.r):
            raise TangramError(
                f"Redis user {user!r} exists without a registry record: remove it first "
                f"(`tangram tenant remove {name} --force`)"
            )
        password, token = new_password(), new_token()
        set_user(self.r, name, password)
        try:
            note = acl_save(self.r)
            record = TenantRecord(
                name=name, quotas=quotas, token_sha256=token_digest(token), created_s=time.time()
            )
            self.store.put_tenant(record)
        except BaseException:
            self.r.execute_command("ACL", "DELUSER", user)  # no user without its record
            raise
        return Secrets(name, client_url(self.url, user, password), token), note

    def rotate(self, name: str, password: bool, token: bool) -> tuple[Secrets, str | None]:
        record = self.record(valid_name(name))
        if record is None:
            raise TangramError(f"no tenant {name!r} (see `tangram tenant list`)")
        user, url, new, note = redis_user(name), None, None, None
        if password:
            pw = new_password()
            set_user(self.r, name, pw)  # the rules as `add` gives them (they may have changed)
            note = acl_save(self.r)
            kill_connections(self.r, user)
            url = client_url(self.url, user, pw)
        if token:
            new = new_token()
            self.store.put_tenant(record.model_copy(update={"token_sha256": token_digest(new)}))
        return Secrets(name, url, new), note

    def remove(self, name: str, force: bool) -> list[str]:
        """Drop the tenant; what was done, line by line."""
        user = redis_user(valid_name(name))
        record = self.record(name)
        has_user = user in redis_users(self.r)
        if record is None and not has_user:
            raise TangramError(f"no tenant {name!r} (see `tangram tenant list`)")
        why = busy(self.r, name)
        if why is not None and not force:
            raise TangramError(
                f"tenant {name!r} has work: {why}; wait for it, or remove it anyway with --force "
                "(its queued actions then never run)"
            )
        done = []
        if has_user:
            self.r.execute_command("ACL", "DELUSER", user)
            note = acl_save(self.r)
            done.append(f"Redis user {user} deleted")
            if note:
                done.append(note)
        killed = kill_connections(self.r, user)
        if killed:
            done.append(f"{killed} connection(s) of {user} closed")
        if self.store.remove_tenant(name):
            done.append(f"tenant {name} removed from the registry (its keys expire with their results)")
        return done


def add_tenant(admin_url: str, name: str, quotas: Quotas | None = None) -> Secrets:
    """`tangram tenant add NAME` from Python (benchmarks, tests, provisioning scripts): the new
    tenant's client URL and HTTP token."""
    from tangram_celery.store import Store

    admin = Admin(admin_url, Store(admin_url, retry_budget_s=5.0))
    try:
        return admin.add(name, quotas or Quotas())[0]
    finally:
        admin.store.close()


# ---- the commands --------------------------------------------------------------------------
def _admin(args: argparse.Namespace) -> Admin:
    from tangram_celery.common.config import default_config_path, load_config
    from tangram_celery.store import Store
    from tangram_celery.transport.broker import resolve_url

    url = args.broker_url or resolve_url(load_config(args.config or default_config_path()))
    return Admin(url, Store(url, retry_budget_s=5.0))


def _note(text: str | None) -> None:
    if text:
        import sys

        print(text, file=sys.stderr)


def cmd_tenant(args: argparse.Namespace) -> int:
    if args.tenant_cmd == "add":
        quotas = quotas_of(args)
        secrets_, note = _admin(args).add(_checked(args.name), quotas)
        print(show_secrets(secrets_, "added", args.json, quotas))
        _note(note)
    elif args.tenant_cmd == "list":
        admin = _admin(args)
        print(show_list(admin.store.tenants(), redis_users(admin.r), args.json))
    elif args.tenant_cmd == "remove":
        for line in _admin(args).remove(_checked(args.name), args.force):
            if line.startswith("note:"):
                _note(line)
            else:
                print(line)
    else:
        pw, tok = not args.token_only, not args.password_only
        secrets_, note = _admin(args).rotate(_checked(args.name), pw, tok)
        print(show_secrets(secrets_, "rotated", args.json))
        _note(note)
    return 0


def _checked(name: str) -> str:
    try:
        return valid_name(name)
    except ValueError as e:
        raise TangramError(str(e)) from None


def add_tenant_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser("tenant", help="tenants: add, list, remove, rotate (the operator's commands)")
    tsub = t.add_subparsers(dest="tenant_cmd", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", "-c", help="deployment YAML (default: configs/local.yaml)")
        p.add_argument("--broker-url", help="the operator's broker URL (default: from the config)")
        p.set_defaults(fn=cmd_tenant)

    add = tsub.add_parser("add", help="make a tenant; prints its client URL and HTTP token once")
    add.add_argument("name")
    add.add_argument("--max-queued", type=int, default=0, help="actions waiting at once (0: no limit)")
    add.add_argument("--max-cores", type=int, default=0, help="cores its running actions hold")
    add.add_argument("--max-memory-mb", type=int, default=0, help="memory its running actions hold")
    add.add_argument("--max-gpu-memory-mb", type=int, default=0, help="GPU memory its reward calls hold")
    add.add_argument(
        "--api-share",
        action="append",
        metavar="API=FRACTION",
        help="share of an API's quota (repeatable), e.g. calc=0.5",
    )
    add.add_argument("--priority", choices=["low", "normal", "high"], default="normal")
    add.add_argument("--json", action="store_true", help="print JSON")
    common(add)

    ls = tsub.add_parser("list", help="tenants with their quotas (never secrets)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    common(ls)

    rm = tsub.add_parser("remove", help="delete a tenant's Redis user and record")
    rm.add_argument("name")
    rm.add_argument("--force", action="store_true", help="even with work queued or running")
    common(rm)

    rot = tsub.add_parser("rotate", help="new password and HTTP token; the old ones stop working")
    rot.add_argument("name")
    only = rot.add_mutually_exclusive_group()
    only.add_argument("--token-only", action="store_true", help="a new HTTP token only")
    only.add_argument("--password-only", action="store_true", help="a new Redis password only")
    rot.add_argument("--json", action="store_true", help="print JSON")
    common(rot)
