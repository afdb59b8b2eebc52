"""compose/docker-compose.yml and configs/multinode.example.yaml agree with the code.

No Docker Compose or image registry here: this checks what can go stale without running them,
namely every service's command against the real CLI parser, the config against the real schema
(with the environment it gets in the containers), and the security defaults.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tangram_celery.cli import build_parser
from tangram_celery.common.config import load_config
from tangram_celery.common.errors import BrokerError
from tangram_celery.transport.broker import expand_env

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
EXAMPLE = ROOT / "configs" / "multinode.example.yaml"
ENV = {"TANGRAM_REDIS_PASSWORD": "s3cret"}  # node and API names: the file's defaults
ROLES = ("admin", "scheduler", "worker-cpu", "worker-gpu", "worker-api", "http", "flower")


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} for the values used here."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if name in env:
            return env[name]
        if op == ":-":
            return arg
        raise AssertionError(f"{name} unset: {arg}")

    return re.sub(r"\$\{([A-Z_]+)(:[-?])?([^}]*)\}", one, value)


def _services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_every_tangram_service_command_is_accepted_by_the_cli() -> None:
    """Given each service that runs the image (entrypoint `tangram`), when its command is parsed
    by the real argument parser, then it parses, and worker nodes/APIs exist in the config."""
    cfg = load_config(EXAMPLE)
    parser = build_parser()
    checked = []
    for name, svc in _services().items():
        if "command" not in svc or svc.get("image", "").startswith("redis") or "entrypoint" in svc:
            continue  # (redis-users runs `python -m tangram_celery.transport.acl`: test_compose_security_defaults)
        argv = [_interpolate(str(a), ENV) for a in svc["command"]]
        args = parser.parse_args(argv)
        assert args.config == "/etc/tangram/tangram.yaml", name
        if args.cmd == "worker" and args.kind in ("cpu", "gpu"):
            # the node comes from $TANGRAM_NODE, else the container's host name (any name joins)
            assert args.node is None and "TANGRAM_NODE" in svc["environment"], name
        if args.cmd == "worker" and args.kind == "api":
            assert args.name in {a.name for a in cfg.apis}
        checked.append(args.cmd if args.cmd != "worker" else f"worker-{args.kind}")
    assert sorted(checked) == ["flower", "scheduler", "serve", "worker-api", "worker-cpu", "worker-gpu"]


def test_the_example_config_validates_and_takes_its_secrets_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given the example config, then it validates, holds no password, and its broker URL gets
    the password and host from the environment (a missing one is a clear error)."""
    cfg = load_config(EXAMPLE)
    assert "${TANGRAM_REDIS_USER}:${TANGRAM_REDIS_PASSWORD}" in cfg.broker.url
    assert cfg.sandbox.network is False
    monkeypatch.delenv("TANGRAM_REDIS_PASSWORD", raising=False)
    monkeypatch.setenv("TANGRAM_REDIS_USER", "scheduler")
    with pytest.raises(BrokerError, match="TANGRAM_REDIS_PASSWORD"):
        expand_env(cfg.broker.url)
    monkeypatch.setenv("TANGRAM_REDIS_PASSWORD", "s3cret")
    monkeypatch.setenv("TANGRAM_REDIS_HOST", "10.0.0.5")
    assert expand_env(cfg.broker.url) == "redis://scheduler:s3cret@10.0.0.5:6379/0"
    # the HTTP API listens beyond loopback in its container, so its token is required
    assert not cfg.http.loopback and cfg.http.token == "${TANGRAM_HTTP_TOKEN}"
    monkeypatch.setenv("TANGRAM_HTTP_TOKEN", "t0ken")
    assert cfg.http.resolved_token() == "t0ken"


def test_compose_security_defaults() -> None:
    """Redis takes its users from the aclfile redis-users renders (default user off) and keeps
    an AOF, with no password on any command line (its own or the health check's); each Tangram
    service connects as its own role's user with that role's password only; Flower requires one; Redis is published on TANGRAM_BIND, the
    unauthenticated metrics and the plain-HTTP Flower only on loopback unless the operator says
    otherwise; the CPU worker keeps Docker's seccomp profile."""
    services = _services()
    redis = services["redis"]
    script = " ".join(str(a) for a in redis["entrypoint"])
    assert "--aclfile /acl/users.acl" in script and "requirepass" not in script
    assert "--appendonly yes" in script and "--protected-mode yes" in script
    assert "command" not in redis and "-a " not in " ".join(redis["healthcheck"]["test"])
    assert redis["environment"]["REDISCLI_AUTH"].startswith("${TANGRAM_REDIS_PASSWORD_ADMIN:?")
    assert redis["depends_on"]["redis-users"]["condition"] == "service_completed_successfully"
    users = services["redis-users"]
    assert users["command"] == ["render", "--out", "/acl/users.acl"]
    want = {f"TANGRAM_REDIS_PASSWORD_{r.upper().replace('-', '_')}" for r in ROLES}
    assert set(users["environment"]) == want
    for name, role in [("scheduler", "scheduler"), ("flower", "flower"), ("http", "http")] + [
        (f"worker-{k}", f"worker-{k}") for k in ("cpu", "gpu", "api")
    ]:
        env = services[name]["environment"]
        assert env["TANGRAM_REDIS_USER"] == role, name
        own = f"TANGRAM_REDIS_PASSWORD_{role.upper().replace('-', '_')}"
        assert env["TANGRAM_REDIS_PASSWORD"].startswith(f"${{{own}:?"), name
        assert not any(k.startswith("TANGRAM_REDIS_PASSWORD_") for k in env), name
    assert services["flower"]["environment"]["TANGRAM_FLOWER_PASSWORD"].startswith(
        "${TANGRAM_FLOWER_PASSWORD:?"
    )
    for name, svc in services.items():
        for port in svc.get("ports", []):
            want = {"redis": "TANGRAM_BIND", "flower": "TANGRAM_FLOWER_BIND"}.get(
                name, "TANGRAM_METRICS_BIND"
            )
            if name == "http" and port.endswith(":8080:8080"):
                want = "TANGRAM_HTTP_BIND"
            assert port.startswith(f"${{{want}:-127.0.0.1}}:"), (name, port)
        for arg in svc.get("command", []):
            assert "PASSWORD" not in str(arg), (name, arg)
    assert services["http"]["environment"]["TANGRAM_HTTP_TOKEN"].startswith("${TANGRAM_HTTP_TOKEN:?")
    assert not any("seccomp" in o for o in services["worker-cpu"]["security_opt"])


def test_the_dockerfile_copies_every_package_the_project_installs() -> None:
    """Given pyproject's package list, then the image build copies each of them."""
    text = (ROOT / "compose" / "Dockerfile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert "tangram_runner" in packages
    for pkg in (*packages, "requirements", "configs"):
        assert f"COPY {pkg} " in text, pkg
    assert 'ENTRYPOINT ["tangram"]' in text
