"""`tangram serve`: run the HTTP server (uvicorn) for a deployment and publish its URL."""

from __future__ import annotations

import logging
import os
import secrets
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from tangram_celery.common.config import TangramConfig
from tangram_celery.common.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("tangram.web")
URL_FILE = "http.url"
TOKEN_FILE = "http.token"  # the token the server made (no http.token set), mode 0600


def missing_extra() -> str | None:
    """Why the HTTP server cannot run here (its packages are missing), or None."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return f"the HTTP server needs the 'http' extra (pip install 'tangram[http]'): {e}"
    return None


def bind(address: str, port: int, prefer: int = 0) -> socket.socket:
    """A listening socket on address:port (port 0: `prefer` if that is free, else any free one),
    so the URL is known before serving."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if port or not prefer:
        sock.bind((address, port))
    else:
        try:
            sock.bind((address, prefer))
        except OSError as e:
            log.warning("http: port %d is taken (%s); a free one is used", prefer, e)
            sock.bind((address, 0))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def write_url(state_dir: str | os.PathLike[str], url: str) -> Path:
    path = Path(state_dir) / URL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(url + "\n")
    tmp.replace(path)
    return path


def server_token(cfg: TangramConfig) -> tuple[str | None, Path | None]:
    """The token the server requires, and the file it is kept in when the server made it: None
    with `http.auth: none`; `http.token` when set; else (loopback only) the one in
    <state_dir>/http.token, made at the first start (random, mode 0600) and kept across restarts."""
    if cfg.http.auth == "none":
        return None, None
    token = cfg.http.resolved_token()
    if token:
        return token, None
    path = Path(cfg.state_dir) / TOKEN_FILE
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        path.chmod(0o600)
        token = path.read_text().strip()
        if token:
            return token, path
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path.read_text().strip(), path


def read_url(state_dir: str | os.PathLike[str]) -> str | None:
    try:
        return (Path(state_dir) / URL_FILE).read_text().strip() or None
    except OSError:
        return None


def serve(
    cfg: TangramConfig,
    broker_url: str,
    *,
    port: int | None = None,
    prefer_port: int = 0,
    address: str | None = None,
    registry: CollectorRegistry | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; the URL is printed and written to <state_dir>/http.url. With
    `http.port` 0, `prefer_port` is tried first (`tangram up`: the last run's port)."""
    why = missing_extra()
    if why is not None:
        raise ConfigError(why)
    import uvicorn

    from tangram_celery.web.app import create_app

    http = cfg.http
    if address is not None or port is not None:
        changes = {"address": address or http.address, "port": http.port if port is None else port}
        http = http.model_validate({**http.model_dump(), **changes})  # validated: token off loopback
        cfg = cfg.model_copy(update={"http": http})
    token, token_path = server_token(cfg)
    app = create_app(cfg, broker_url, registry=registry, token=token)
    sock = bind(http.address, http.port, prefer_port)
    url = url_of(sock)
    path = write_url(cfg.state_dir, url)
    print(f"http: {url} (docs {url}/docs; SandboxFusion URL {url}/run_code); url in {path}", flush=True)
    if token_path is not None:
        print(f"http: token in {token_path} (send 'Authorization: Bearer <its content>')", flush=True)
    elif token is None:
        print("http: no token (http.auth: none); only this host can reach it", flush=True)
    config = uvicorn.Config(
        app,
        loop="auto",
        http="auto",
        access_log=False,  # a token may travel in the query string (opt-in); and it costs time
        log_level="warning",
        backlog=2048,
        timeout_keep_alive=30,
        limit_concurrency=None,
    )
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])  # uvloop and httptools when installed (the 'http' extra)
    finally:
        sock.close()
        if read_url(cfg.state_dir) == url:
            (Path(cfg.state_dir) / URL_FILE).unlink(missing_ok=True)
