"""Start and stop a whole local deployment: embedded Redis, scheduler, one worker per pool, Flower.

Used by `tangram up`, `tangram demo` and the integration tests. Every child is a real process
started here and stopped here by its pid. Nothing outlives this process: every child is started
from one long-lived thread and arms a parent-death signal, then checks that this process still
lives (`tangram_celery/common/lifeline.py`): Python children from their entry point, Redis and Flower
through the exec wrapper. A start that fails part-way stops what it had started.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import redis
import yaml

from tangram_celery.common import lifeline
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.errors import TangramError
from tangram_celery.common.records import WarmStatus
from tangram_celery.store import Store, redact
from tangram_celery.transport.broker import URL_FILE, EmbeddedRedis, write_url

HTTP_PORT_FILE = "http.port"  # the HTTP server's last port, kept across runs (state dir)

log = logging.getLogger("tangram.deploy")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)  # monotonic times of restarts
    # how to start it again when it is not `tangram <args>` (Flower); None with no args: never
    again: Callable[[], Child] | None = None


@dataclass
class Deployment:
    """A running local deployment of `cfg` (written to `config_path` for the children)."""

    cfg: TangramConfig
    config_path: Path
    with_flower: bool = True
    redis: EmbeddedRedis | None = None
    url: str = ""
    children: dict[str, Child] = field(default_factory=dict)
    flower_url: str = ""
    flower_auth: tuple[str, str] = ("", "")
    with_http: bool = True
    http_url: str = ""
    max_restarts_per_min: int = 5
    _redis_restarts: list[float] = field(default_factory=list)
    _redis_given_up: bool = False
    metrics_ports: dict[str, int] = field(default_factory=dict)
    _supervisor: threading.Thread | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def state_dir(self) -> Path:
        return Path(self.cfg.state_dir)

    def start(self, progress: bool = True) -> Deployment:
        """Start everything and wait until it is ready; on any failure (or a signal that
        interrupts it), stop what was started and re-raise."""
        try:
            return self._start(progress)
        except BaseException:
            self.stop()
            raise

    def _start(self, progress: bool) -> Deployment:
        say = print if progress else log.info
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        gpu = gpu_worker_nodes(self.cfg)
        if gpu:  # before any child starts: nothing is left running when this fails
            from reward_servers.backends.deps import check_serving
            from reward_servers.tiny_models import build_missing

            check_serving(self.cfg)
            build_missing(self.cfg, say)  # once: the model stays in place for the next start
        if self.cfg.broker.url == "embedded":
            say("starting embedded redis ...")
            self.redis = EmbeddedRedis(
                self.state_dir / "redis",
                fsync=self.cfg.broker.fsync,
                maxmemory_mb=self.cfg.broker.maxmemory_mb,
                die_with_parent=True,
                keep_address=True,  # the same URL as the last run's: its clients reconnect
            ).start()
            self.url = self.redis.url
        else:
            self.url = self.cfg.broker.url
            Store(self.url).ping()
        write_url(self.state_dir, self.url)
        say(f"broker: {redact(self.url)}")
        self.spawn("scheduler", ["scheduler"])
        # Celery's task events are for Flower: without it, a worker publishes none per task
        # (a monitor started later turns them on, `tangram worker --task-events`)
        events = ["--task-events", "on" if self.with_flower else "off"]
        for n in self.cfg.nodes.cpu:
            self.spawn(f"worker-cpu-{n.name}", ["worker", "cpu", "--node", n.name, *events])
        for a in self.cfg.apis:
            self.spawn(f"worker-api-{a.name}", ["worker", "api", "--name", a.name, *events])
        if gpu:
            store = Store(self.url)
            for g in gpu:  # a status left by an earlier run of this broker is not this run's
                store.set_warm_status(g, None)
            store.close()
        for g in gpu:
            self.spawn(f"worker-gpu-{g}", ["worker", "gpu", "--node", g, *events])
        if self.with_flower:
            self._start_flower()
        http = self._start_http(say)
        self.wait_ready(progress=progress)
        if http:
            self.http_url = self._wait_http_url()
            self._keep_http_port()
        warm = warm_nodes(self.cfg)
        if warm:
            services = [m.name for m in self.cfg.reward_models if m.backend != "rule"]
            say(
                f"warming {len(services)} reward service(s) ({', '.join(services)}) on GPU node(s) "
                f"{', '.join(warm)} in the background"
            )
            threading.Thread(
                target=self._report_warm_up, args=(say,), name="tangram-warm-up", daemon=True
            ).start()
        self._supervisor = threading.Thread(target=self._supervise, name="tangram-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def wait_warm(self, timeout_s: float = 300.0) -> dict[str, WarmStatus]:
        """Block until every GPU worker finished warming its services (see `wait_warm`)."""
        return wait_warm(self.url, warm_nodes(self.cfg), timeout_s, self._stopping)

    def _report_warm_up(self, say: Callable[[str], object]) -> None:
        try:
            status = self.wait_warm()
        except Exception as e:  # the deployment stopped, or warming is slow: requests load on demand
            log.info("warm-up not reported: %s", e)
            return
        for node, st in sorted(status.items()):
            loaded, failed = st.loaded, st.failed
            line = f"reward services warm on {node}: {len(loaded)} replica(s) in {st.seconds:.1f} s"
            if failed:
                line += f"; failed: {', '.join(failed)} (they load on demand; see the worker's log)"
            say(line)

    def _supervise(self, every_s: float = 0.5) -> None:
        """Restart children that exit (crash, kill, stuck-consumer exit) and the embedded Redis
        when it dies, like a process manager."""
        while not self._stopping.wait(every_s):
            with self._lock:
                if self._stopping.is_set():
                    break
                self._revive_redis()
                for c in list(self.children.values()):
                    if c.proc.poll() is None or not (c.args or c.again) or self._stopping.is_set():
                        continue
                    if not self._may_restart(c.name, c.restarts):
                        c.args, c.again = [], None
                        continue
                    log.warning("%s exited with %s; restarting", c.name, c.proc.returncode)
                    new = c.again() if c.again is not None else self.spawn(c.name, c.args)
                    new.restarts = c.restarts

    def _may_restart(self, name: str, restarts: list[float]) -> bool:
        """Count one more restart of `name` in `restarts` (the last minute's); False, said
        once in the log, when it has exited too often to try again."""
        now = time.monotonic()
        restarts[:] = [t for t in restarts if now - t < 60] + [now]
        if len(restarts) > self.max_restarts_per_min:
            log.error("%s keeps exiting (%d restarts in 60 s); giving up", name, len(restarts))
            return False
        return True

    def _revive_redis(self) -> None:
        """The embedded Redis died on its own (crashed, OOM-killed): start it again on its port,
        password and data. Its append-only file keeps what was fsynced (`broker.fsync`); the
        scheduler rebuilds its state from it and workers and clients reconnect, as after any
        Redis restart. Without this every component would wait for a server nobody starts."""
        r = self.redis
        if r is None or self._redis_given_up or not r.exited():
            return
        if not self._may_restart("embedded redis", self._redis_restarts):
            self._redis_given_up = True
            return
        assert r.proc is not None
        log.warning(
            "embedded redis exited with %s; restarting it on the same port and data", r.proc.returncode
        )
        try:
            r.restart()
        except TangramError as e:  # (the next round tries again, up to the restart limit)
            log.error("embedded redis did not restart: %s", e)

    def spawn(self, name: str, args: list[str]) -> Child:
        """Start `tangram <args>` as a child process logging to <state_dir>/logs/<name>.log.

        With metrics enabled, the child serves Prometheus metrics on a free port, kept across
        restarts and listed in <state_dir>/metrics.json.
        """
        if self.cfg.metrics.enabled and "--metrics-port" not in args:
            from tangram_celery.common.metrics import write_targets
            from tangram_celery.transport.broker import _free_port

            self.metrics_ports[name] = _free_port()
            args = [*args, "--metrics-port", str(self.metrics_ports[name])]
            write_targets(self.state_dir, self.metrics_ports)
        log_path = self._log_path(name)
        # the child arms its parent-death signal against this pid first thing (cli.main)
        env = dict(
            os.environ,
            TANGRAM_BROKER_URL=self.url,
            PYTHONUNBUFFERED="1",
            **{lifeline.PARENT_ENV: str(os.getpid())},
        )
        cmd = [sys.executable, "-m", "tangram_celery.cli", *args, "--config", str(self.config_path)]
        self.children[name] = Child(name, self._popen(cmd, log_path, env), log_path, args)
        return self.children[name]

    def _start_http(self, say: Callable[[str], None]) -> bool:
        """`tangram serve` as one more child, when configured and its extra is installed."""
        from tangram_celery.web.serve import URL_FILE, missing_extra

        if not (self.with_http and self.cfg.http.enabled):
            return False
        why = missing_extra()
        if why is not None:
            say(f"http server not started: {why}")
            return False
        (self.state_dir / URL_FILE).unlink(missing_ok=True)
        args = ["serve"]
        port = self._last_http_port()
        if port:  # tried first: taken, the server takes a free one
            args += ["--prefer-port", str(port)]
        self.spawn("http", args)
        return True

    def _last_http_port(self) -> int:
        """With `http.port: 0`, the port the last run's server had (`HTTP_PORT_FILE` in the
        state dir): a restart of `tangram up` keeps the HTTP URL too. The server binds it if it
        is free, else a free one (`tangram serve --prefer-port`)."""
        if self.cfg.http.port:
            return 0
        try:
            return int((self.state_dir / HTTP_PORT_FILE).read_text())
        except (OSError, ValueError):
            return 0

    def _keep_http_port(self) -> None:
        """A restarted `tangram serve` binds the port the first one got (`http.port: 0` picks a
        free one): HTTP clients (SandboxFusion's, verl's) keep the URL `tangram up` printed
        instead of losing the server for good after its first crash. The next `tangram up`
        over this state takes it again (`_last_http_port`)."""
        port = urlsplit(self.http_url).port
        child = self.children.get("http")
        if child is not None and port and "--port" not in child.args:
            child.args = [*child.args, "--port", str(port)]
        if port:
            (self.state_dir / HTTP_PORT_FILE).write_text(str(port))

    def _wait_http_url(self, timeout_s: float = 30.0) -> str:
        from tangram_celery.web.serve import read_url

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            url = read_url(self.state_dir)
            if url:
                return url
            time.sleep(0.05)
        raise TangramError(
            f"http server wrote no URL in {timeout_s}s; see {self.state_dir / 'logs' / 'http.log'}"
        )

    def _log_path(self, name: str) -> Path:
        logs = self.state_dir / "logs"
        logs.mkdir(mode=0o700, parents=True, exist_ok=True)
        return logs / f"{name}.log"

    @staticmethod
    def _popen(cmd: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Start `cmd` from the process's one spawner thread (parent-death fires per thread)."""
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            proc: subprocess.Popen[bytes] = lifeline.spawn(
                subprocess.Popen,
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a Ctrl-C in the terminal reaches only us; we stop them
            )
        finally:
            os.close(fd)
        return proc

    def _start_flower(self) -> None:
        from tangram_celery.transport.broker import _free_port

        port = self.cfg.flower.port or _free_port()
        password = self.cfg.flower.password or secrets.token_urlsafe(12)
        self.flower_auth = (self.cfg.flower.user, password)
        self.flower_url = f"http://127.0.0.1:{port}"
        self._spawn_flower(port)

    def _spawn_flower(self, port: int) -> Child:
        """Flower on `port` with the deployment's credentials; the supervisor starts it again
        the same way (same URL and password) when it exits."""
        cmd, extra = flower_command(self.url, port, "127.0.0.1", self.flower_auth, pool_queues(self.cfg))
        log_path = self._log_path("flower")
        proc = self._popen(lifeline.wrapper_argv(cmd, os.getpid()), log_path, dict(os.environ, **extra))
        child = Child("flower", proc, log_path, again=lambda: self._spawn_flower(port))
        self.children["flower"] = child
        return child

    def wait_ready(self, timeout_s: float = 60.0, progress: bool = True) -> None:
        """Wait until the scheduler published its pools and every worker answers a ping."""
        store = Store(self.url)
        expected = {n.split("worker-", 1)[1] for n in self.children if n.startswith("worker-")}
        deadline = time.monotonic() + timeout_s
        from tangram_celery.transport.app import make_app

        app = make_app(self.url)
        seen: set[str] = set()
        while time.monotonic() < deadline:
            self.check_alive()
            if store.pool_view() is not None:
                try:
                    replies = app.control.ping(timeout=0.5) or []
                except (OSError, redis.RedisError):  # a pooled connection to an earlier server
                    replies = []  # of this URL (a stack restarted in this process): once more
                seen = {name.split("@")[0] for r in replies for name in r}
                if expected <= seen:
                    if progress:
                        print(f"ready: scheduler + {len(seen)} worker(s)")
                    store.close()
                    return
            time.sleep(0.2)
        store.close()
        raise TangramError(
            f"deployment not ready in {timeout_s}s; workers seen: {sorted(seen)}, "
            f"expected {sorted(expected)}; logs in {self.state_dir / 'logs'}"
        )

    def check_alive(self) -> None:
        for c in self.children.values():
            if c.proc.poll() is not None:
                tail = c.log_path.read_text(errors="replace")[-2000:] if c.log_path.exists() else ""
                raise TangramError(f"{c.name} exited with {c.proc.returncode}; last log lines:\n{tail}")

    def counter(self, name: str, metric: str) -> float:
        """The sum of counter `metric`'s samples on child `name`'s metrics endpoint (e.g. the
        scheduler's `tangram_cpu_batch_joins_total`)."""
        import urllib.request

        url = f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(metric + "{")
        )

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Signal one child (fault injection) and reap it; the supervisor restarts it. Returns its pid."""
        with self._lock:
            c = self.children[name]
            if c.proc.poll() is None:
                os.killpg(c.proc.pid, sig)
                c.proc.wait(timeout=30)
            return c.proc.pid

    def stop(self) -> None:
        """Stop every child (SIGTERM, SIGKILL after 15 s) and the embedded Redis (idempotent)."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        for c in reversed(list(self.children.values())):
            if c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for c in self.children.values():
            try:
                c.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        self.children.clear()
        if self.redis is not None:
            with self._lock:  # not while the supervisor restarts it
                self.redis.stop()
            (self.state_dir / URL_FILE).unlink(missing_ok=True)
        (self.state_dir / "http.url").unlink(missing_ok=True)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def gpu_worker_nodes(cfg: TangramConfig) -> list[str]:
    """GPU nodes that get a worker (and Triton): those of a config with Triton-served models."""
    if not any(m.backend != "rule" for m in cfg.reward_models):
        return []
    return [g.name for g in cfg.nodes.gpu]


def warm_nodes(cfg: TangramConfig) -> list[str]:
    """GPU nodes whose worker warms the reward services at start (`nodes.gpu[].warm_up`)."""
    gpu = set(gpu_worker_nodes(cfg))
    return [g.name for g in cfg.nodes.gpu if g.name in gpu and g.warm_up]


def wait_warm(
    url: str, nodes: list[str], timeout_s: float = 300.0, stop: threading.Event | None = None
) -> dict[str, WarmStatus]:
    """Block until the GPU workers of `nodes` finished warming their services; node -> warm-up
    status (`loaded` replicas, `failed` ones, `seconds`). Raises TangramError on timeout."""
    store = Store(url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            status = store.warm_status()
            if all(n in status and status[n].state == "done" for n in nodes):
                return {n: status[n] for n in nodes}
            if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                raise TangramError(f"reward services not warm after {timeout_s:.0f} s: {status}")
            time.sleep(0.25)
    finally:
        store.close()


def write_config(cfg: TangramConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


def pool_queues(cfg: TangramConfig) -> list[str]:
    """The Celery queue of every configured pool: tangram.cpu.*, tangram.gpu.*, tangram.api.*."""
    from tangram_celery.transport.app import queue_name

    gpu = [g.name for g in cfg.nodes.gpu if any(m.backend != "rule" for m in cfg.reward_models)]
    return (
        [queue_name("cpu", n.name) for n in cfg.nodes.cpu]
        + [queue_name("gpu", g) for g in gpu]
        + [queue_name("api", a.name) for a in cfg.apis]
    )


def flower_command(
    broker_url: str, port: int, address: str, auth: tuple[str, str], queues: list[str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Flower on `address`:`port` with basic auth always on: (argv, extra environment).

    The broker URL and the credentials go through the environment (Celery's BROKER_URL,
    Flower's FLOWER_BASIC_AUTH), so that no password shows in the process list. Flower runs
    with `tangram_celery.flower_app`, whose broker page lists `queues` (with their lengths)
    even before Flower has inspected the workers that consume them.
    """
    argv = [sys.executable, "-m", "celery", "-A", "tangram_celery.flower_app", "flower"]
    argv += [f"--port={port}", f"--address={address}"]
    env = {
        "TANGRAM_FLOWER_QUEUES": ",".join(queues or []),
        "BROKER_URL": broker_url,
        "FLOWER_BASIC_AUTH": f"{auth[0]}:{auth[1]}",
        "FLOWER_UNAUTHENTICATED_API": "",
        "FLOWER_INSPECT_TIMEOUT": "5000",  # ms; the 1 s default misses workers on a busy host
        # The args column shows each task's action kind and trajectory (the scheduler's argsrepr);
        # Flower 2.2 hides it by default. Search e.g. `args:trajectory=demo-3`.
        "FLOWER_TASKS_COLUMNS": "name,uuid,state,args,received,runtime,worker",
    }
    return argv, env
