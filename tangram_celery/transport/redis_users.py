"""The embedded Redis's users on disk: role passwords, the aclfile, the unprivileged account.

Files in the data directory (`EmbeddedRedis`):
- `users.acl`: the aclfile (`aclfile` directive), owned by the server's account so that `ACL
  SAVE` (`tangram tenant`) rewrites it; every start rewrites the role users and `default` in it
  and keeps every other user (the tenants');
- `passwords.json`: role -> password, 0600 and kept by the account that started the server
  (root, when the server runs as `redis`): the URLs of the next start (`keep_address`).

A data directory from before the roles (`requirepass` on the default user in its `redis.conf`,
no aclfile) is upgraded in place: its data stays, the role users are created with the old
password as the admin's, and the default user is turned off.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import secrets
from dataclasses import dataclass
from pathlib import Path

from tangram_celery.common.errors import BrokerError
from tangram_celery.transport import acl
from tangram_celery.transport.private_file import write_private

log = logging.getLogger(__name__)

ACL_FILE = "users.acl"
PASSWORDS_FILE = "passwords.json"
SERVER_ACCOUNT = "redis"  # Debian's redis-server package creates it


@dataclass(frozen=True)
class Account:
    """The unprivileged account the server runs as (started by root)."""

    name: str
    uid: int
    gid: int


def server_account() -> Account | None:
    """`redis` when this process is root (the server must not be: `CONFIG SET dir` plus a save
    would write anywhere), else None: the server runs as the current user."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(SERVER_ACCOUNT)
    except KeyError:
        raise BrokerError(
            f"the embedded Redis runs as the unprivileged '{SERVER_ACCOUNT}' user when started by root, "
            "and there is none: install Debian's redis-server package (scripts/setup-system.sh demo)"
        ) from None
    return Account(pw.pw_name, pw.pw_uid, pw.pw_gid)


def old_requirepass(data_dir: Path) -> str | None:
    """The default user's password of a server from before the roles (its `redis.conf`), or None."""
    try:
        lines = (data_dir / "redis.conf").read_text().splitlines()
    except OSError:
        return None
    conf = dict(line.split(" ", 1) for line in lines if " " in line)
    return conf.get("requirepass") or None


def load_passwords(data_dir: Path) -> dict[str, str]:
    """The role passwords of the last start, {} when none (or unreadable)."""
    try:
        got = json.loads((data_dir / PASSWORDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {r: str(got[r]) for r in acl.ROLES if isinstance(got, dict) and got.get(r)}


def role_passwords(data_dir: Path, admin: str | None, keep: bool) -> dict[str, str]:
    """Every role's password: `admin` if given; with `keep`, the last start's (or, on a data
    directory from before the roles, its password as the admin's); new ones for the rest."""
    old = load_passwords(data_dir) if keep else {}
    if keep and not old:
        legacy = old_requirepass(data_dir)
        if legacy and not (data_dir / ACL_FILE).exists():
            old = {acl.ADMIN: legacy}
    out = {r: old.get(r) or secrets.token_urlsafe(24) for r in acl.ROLES}
    if admin:
        out[acl.ADMIN] = admin
    return out


def write_users(data_dir: Path, passwords: dict[str, str], account: Account | None) -> None:
    """Write `passwords.json` and `users.acl` (role users and `default` replaced, any other
    user kept); on a data directory from before the roles, say that it is being upgraded."""
    acl_path = data_dir / ACL_FILE
    legacy = old_requirepass(data_dir)
    if legacy and not acl_path.exists():
        log.warning(
            "upgrading the embedded Redis in %s to ACL users: its data is kept, one user per role is "
            "created (the old password becomes the admin's) and the default user is turned off; a "
            "client of the old URL must take a new one (broker.url, secrets/<role>.url)",
            data_dir,
        )
    existing = acl_path.read_text() if acl_path.exists() else ""
    write_private(data_dir / PASSWORDS_FILE, json.dumps(passwords))
    write_private(acl_path, acl.merge_acl_file(passwords, existing))
    if account is not None:
        os.chown(acl_path, account.uid, account.gid)


def hand_over(data_dir: Path, account: Account | None) -> None:
    """Make the data directory the server account's (AOF, log, config, aclfile), except the
    passwords, which stay this account's: files an older version left as root's included."""
    if account is None:
        return
    for root, dirs, files in os.walk(data_dir):
        for name in dirs + files:
            path = os.path.join(root, name)
            if not os.path.islink(path) and not (root == str(data_dir) and name == PASSWORDS_FILE):
                os.chown(path, account.uid, account.gid)
    os.chown(data_dir, account.uid, account.gid)


def drop_privileges_argv(account: Account | None) -> list[str]:
    """The command prefix that runs a program as `account` (util-linux's setpriv), [] for none."""
    if account is None:
        return []
    return ["setpriv", f"--reuid={account.uid}", f"--regid={account.gid}", "--init-groups", "--"]
