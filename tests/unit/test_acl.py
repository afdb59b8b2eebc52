"""The Redis users of a deployment's roles and tenants (tangram_celery.transport.acl)."""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from tangram_celery.common import tenants
from tangram_celery.store import keys
from tangram_celery.transport import acl

# every shared key of the store (keys.py's constants, the registry and the memory report)
SHARED = [
    keys.INTAKE,
    keys.EVENTS,
    keys.RUNNING,
    keys.TRAJ,
    keys.CONFIG,
    keys.DEAD,
    keys.WORKERS,
    keys.WORKER_POOLS,
    keys.SANDBOXES,
    keys.RESETS,
    keys.WARM,
    keys.LANGS,
    keys.IMAGES,
    keys.NODES,
    keys.NODE_LOAD,
    tenants.REGISTRY,
    "tangram:memory",
]
CELERY = [
    "tangram.cpu.n0",
    "tangram.cpu.n0\x06\x163",
    "_kombu.binding.celery.pidbox",
    "unacked",
    "unacked_index",
]
CELERY += [
    "worker-cpu-n0@host.celery.pidbox",
    "1b2c.reply.celery.pidbox",
    "1b2c.reply.celery.pidbox\x06\x169",
]
CELERY += ["celeryev.5e1f"]  # Flower's event receiver queue (kombu sizes it)


def patterns(rules: list[str]) -> tuple[list[str], list[str]]:
    """(read-write patterns, read-only patterns) of ACL rules."""
    rw = [r[1:] for r in rules if r.startswith("~")]
    ro = [r[3:] for r in rules if r.startswith("%R~")]
    return rw, ro


def reads(rules: list[str], key: str) -> bool:
    rw, ro = patterns(rules)
    return any(fnmatchcase(key, p) for p in rw + ro)


def writes(rules: list[str], key: str) -> bool:
    return any(fnmatchcase(key, p) for p in patterns(rules)[0])


def work_keys(tenant: str) -> list[str]:
    p = tenants.prefix(tenant)
    return [p + "intake", p + "a:x1", p + "n:x1", p + "nq:c1", p + "a:a:b"]


@pytest.mark.unit
@pytest.mark.parametrize("tenant", ["acme", "a", "default", "t"])
def test_a_tenant_reaches_its_own_work_and_no_one_elses(tenant: str) -> None:
    """A tenant writes its intake, actions, results and notify lists; never another tenant's
    key, a shared key, or Celery's; it reads only its limits and the shared keys its client needs."""
    rules = acl.tenant_rules(tenant)
    assert all(writes(rules, k) for k in work_keys(tenant))
    for other in ("acme", "acme-2", "b", "a", "default", "t", "tt"):
        if other != tenant:
            for k in [*work_keys(other), tenants.prefix(other) + "limits"]:
                assert not reads(rules, k), (tenant, k)
    assert reads(rules, tenants.prefix(tenant) + "limits")
    assert not writes(rules, tenants.prefix(tenant) + "limits")
    for k in SHARED:
        if k in work_keys(tenant):  # the default tenant's intake is `tangram:intake`
            continue
        assert not writes(rules, k), k
        assert reads(rules, k) == (k in acl.TENANT_READABLE), k
    assert not any(reads(rules, k) for k in CELERY)


@pytest.mark.unit
def test_a_tenant_has_no_channel_and_only_client_commands() -> None:
    """No pub/sub channel; every command is added one by one after -@all (no category, no
    admin command)."""
    rules = acl.tenant_rules("acme")
    assert "resetchannels" in rules and not any(r.startswith("&") for r in rules)
    commands = rules[rules.index("-@all") + 1 :]
    assert commands and all(c.startswith("+") and "@" not in c for c in commands)
    bad_ones = (
        "+config",
        "+flushall",
        "+publish",
        "+lpush",
        "+keys",
        "+scan",
        "+info",
        "+eval",
        "+script|load",
    )
    for bad in bad_ones:
        assert bad not in commands


@pytest.mark.unit
def test_a_bad_tenant_name_is_refused() -> None:
    """A name that could carry a glob or a colon never becomes a key pattern."""
    for bad in ("a*", "a:b", "A", "", "x?"):
        with pytest.raises(ValueError):
            acl.tenant_rules(bad)


@pytest.mark.unit
def test_the_aclfile_turns_the_default_user_off_and_hashes_passwords() -> None:
    """Every role has a user with its password's SHA-256 (never the password); default is off."""
    passwords = {r: f"secret-{r}" for r in acl.ROLES}
    text = acl.acl_file(passwords)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["user", "default", "off"]
    assert "nopass" not in text and "secret-" not in text
    users = {line.split()[1]: line.split()[2:] for line in lines}
    assert set(users) == {"default", *acl.ROLES}
    for role in acl.ROLES:
        assert users[role][:2] == ["on", acl.password_digest(f"secret-{role}")]
    with pytest.raises(ValueError, match="flower"):
        acl.acl_file({r: "x" for r in acl.ROLES if r != "flower"})


@pytest.mark.unit
def test_roles_other_than_admin_have_no_admin_or_dangerous_command() -> None:
    """Every role but admin drops @admin and @dangerous after its grants."""
    for role in acl.ROLES[1:]:
        rules = acl.role_rules(role)
        assert "-@admin" in rules and "-@dangerous" in rules
        after = rules[rules.index("-@dangerous") + 1 :]
        assert all(r in ("+info", "-function", "-script|flush", "-script|kill", "-@pubsub") for r in after), (
            role
        )
        assert "~*" not in rules and "&*" not in rules


@pytest.mark.unit
def test_workers_and_http_cannot_read_the_registry_or_celery_as_they_should_not() -> None:
    """Workers: all tenants' work and Celery, not the tenant registry; http: every tenant's
    work, the registry read-only, nothing of Celery's and no channel; flower: Celery only."""
    for role in acl.WORKER_ROLES:
        rules = acl.role_rules(role)
        assert not reads(rules, tenants.REGISTRY)
        assert all(writes(rules, k) for t in ("default", "acme") for k in work_keys(t))
        assert all(writes(rules, k) for k in CELERY)
        assert not writes(rules, keys.CONFIG) and reads(rules, keys.CONFIG)
    http = acl.role_rules("http")
    assert reads(http, tenants.REGISTRY) and not writes(http, tenants.REGISTRY)
    assert all(writes(http, k) for t in ("default", "acme") for k in work_keys(t))
    assert not any(reads(http, k) for k in CELERY)
    assert not any(r.startswith("&") for r in http)
    flower = acl.role_rules("flower")
    assert all(writes(flower, k) for k in CELERY)
    assert not any(reads(flower, k) for t in ("default", "acme") for k in work_keys(t))
    assert not reads(flower, tenants.REGISTRY)


@pytest.mark.unit
def test_celery_roles_get_the_exact_channels_kombu_subscribes() -> None:
    """PSUBSCRIBE is allowed only by an identical channel pattern: the ones kombu uses."""
    for role in ("scheduler", *acl.WORKER_ROLES, "flower"):
        rules = acl.role_rules(role, db=3)
        assert {r[1:] for r in rules if r.startswith("&")} == {"/3.celeryev/*", "/3.celery.pidbox"}


@pytest.mark.unit
def test_setuser_args_reset_the_user_first() -> None:
    args = acl.setuser_args("tenant-acme", "pw", acl.tenant_rules("acme"))
    assert args[:4] == ["tenant-acme", "reset", "on", acl.password_digest("pw")]
    assert "pw" not in args


@pytest.mark.unit
def test_render_reads_each_password_from_its_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for role in acl.ROLES:
        monkeypatch.setenv(acl.env_name(role), "p-" + role)
    assert acl.env_name("worker-cpu") == "TANGRAM_REDIS_PASSWORD_WORKER_CPU"
    assert acl.main(["render"]) == 0
    assert acl.password_digest("p-flower") in capsys.readouterr().out
    monkeypatch.delenv(acl.env_name("http"))
    assert acl.main(["render"]) == 1


@pytest.mark.unit
def test_render_into_a_file_keeps_its_tenants(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Rendering over an aclfile rewrites the role users and keeps the tenants saved in it."""
    for role in acl.ROLES:
        monkeypatch.setenv(acl.env_name(role), "p-" + role)
    out = tmp_path / "users.acl"
    out.write_text("user default on nopass ~* +@all\nuser tenant-acme on #abc ~tangram:t:acme:*\n")
    assert acl.main(["render", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("user default off") and "nopass" not in out.read_text()
    assert lines[-1] == "user tenant-acme on #abc ~tangram:t:acme:*"
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    assert acl.main(["render", "--out"]) == 2
