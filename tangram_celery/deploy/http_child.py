"""The HTTP server child (`tangram serve`): its URL, and its port kept across restarts."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from tangram_celery.common.config import TangramConfig
from tangram_celery.common.errors import TangramError
from tangram_celery.deploy.children import Child

HTTP_PORT_FILE = "http.port"  # the HTTP server's last port, kept across runs (state dir)


def last_http_port(cfg: TangramConfig, state_dir: Path) -> int:
    """With `http.port: 0`, the port the last run's server had (`HTTP_PORT_FILE` in the
    state dir): a restart of `tangram up` keeps the HTTP URL too. The server binds it if it
    is free, else a free one (`tangram serve --prefer-port`)."""
    if cfg.http.port:
        return 0
    try:
        return int((state_dir / HTTP_PORT_FILE).read_text())
    except (OSError, ValueError):
        return 0


def keep_http_port(http_url: str, child: Child | None, state_dir: Path) -> None:
    """A restarted `tangram serve` binds the port the first one got (`http.port: 0` picks a
    free one): HTTP clients (SandboxFusion's, verl's) keep the URL `tangram up` printed
    instead of losing the server for good after its first crash. The next `tangram up`
    over this state takes it again (`last_http_port`)."""
    port = urlsplit(http_url).port
    if child is not None and port and "--port" not in child.args:
        child.args = [*child.args, "--port", str(port)]
    if port:
        (state_dir / HTTP_PORT_FILE).write_text(str(port))


def wait_http_url(state_dir: Path, check_alive: Callable[[], None], timeout_s: float = 30.0) -> str:
    """The URL the HTTP server wrote once it listens; `check_alive` raises when a child died."""
    from tangram_celery.web.serve import read_url

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check_alive()
        url = read_url(state_dir)
        if url:
            return url
        time.sleep(0.05)
    raise TangramError(f"http server wrote no URL in {timeout_s}s; see {state_dir / 'logs' / 'http.log'}")


def http_access_note(cfg: TangramConfig, state_dir: Path) -> str:
    """How a caller gets in, for `tangram up` to print: where the token the server made is
    (no `http.token` set), or that it needs none (`http.auth: none`, loopback only)."""
    from tangram_celery.web.serve import TOKEN_FILE

    if cfg.http.auth == "none":
        return "http: no token (http.auth: none; loopback only)"
    if cfg.http.token:
        return "http: token from http.token (Authorization: Bearer TOKEN)"
    return f"http: token in {state_dir / TOKEN_FILE} (Authorization: Bearer <its content>)"
