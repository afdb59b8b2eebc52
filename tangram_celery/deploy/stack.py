"""`Deployment`: the whole local stack, started and stopped in order, its children supervised."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import tangram_celery.deploy.children as kids
from tangram_celery.common import lifeline
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.errors import TangramError
from tangram_celery.common.records import WarmStatus
from tangram_celery.deploy.children import Child
from tangram_celery.deploy.flower import flower_command, pool_queues
from tangram_celery.deploy.http_child import keep_http_port, last_http_port, wait_http_url
from tangram_celery.deploy.readiness import (
    announce_warm_up,
    gpu_worker_nodes,
    wait_ready,
    wait_warm,
    warm_nodes,
)
from tangram_celery.store import Store, redact
from tangram_celery.transport.broker import (
    SECRETS_DIR,
    URL_FILE,
    EmbeddedRedis,
    resolve_url,
    write_role_urls,
    write_url,
)

log = logging.getLogger("tangram.deploy")


@dataclass
class Deployment:
    """A running local deployment of `cfg` (written to `config_path` for the children)."""

    cfg: TangramConfig
    config_path: Path
    with_flower: bool = True
    redis: EmbeddedRedis | None = None
    url: str = ""  # the admin's (the operator's); each child gets its role's (`role_url`)
    role_urls: dict[str, str] = field(default_factory=dict)
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
        self._start_broker(say)
        self.spawn("scheduler", ["scheduler"])
        self._start_workers(gpu)
        if self.with_flower:
            self._start_flower()
        http = self._start_http(say)
        self.wait_ready(progress=progress)
        if http:
            self.http_url = wait_http_url(self.state_dir, self.check_alive)
            keep_http_port(self.http_url, self.children.get("http"), self.state_dir)
        announce_warm_up(self.cfg, self.url, self._stopping, say)
        self._supervisor = threading.Thread(target=self._supervise, name="tangram-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def _start_broker(self, say: Callable[[str], None]) -> None:
        """The embedded Redis (on the last run's address), or a ping of the configured one."""
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
            self.role_urls = self.redis.role_urls()
            write_role_urls(self.state_dir, self.role_urls)
        else:
            self.url = resolve_url(self.cfg)  # ${VAR} expanded, broker.tls in a rediss:// URL
            Store(self.url).ping()
        write_url(self.state_dir, self.url)
        say(f"broker: {redact(self.url)}")

    def role_url(self, child: str) -> str:
        """The broker URL child `child` connects with: its role's user on the embedded Redis
        (`worker-cpu-n0` -> `worker-cpu`), the configured URL otherwise."""
        role = next((r for r in self.role_urls if child == r or child.startswith(r + "-")), None)
        return self.role_urls[role] if role is not None else self.url

    def _start_workers(self, gpu: list[str]) -> None:
        """One worker per CPU node, API and GPU node (`gpu`: those that get one)."""
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

    def wait_warm(self, timeout_s: float = 300.0) -> dict[str, WarmStatus]:
        """Block until every GPU worker finished warming its services (see `wait_warm`)."""
        return wait_warm(self.url, warm_nodes(self.cfg), timeout_s, self._stopping)

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
                    if not kids.may_restart(c.name, c.restarts, self.max_restarts_per_min):
                        c.args, c.again = [], None
                        continue
                    log.warning("%s exited with %s; restarting", c.name, c.proc.returncode)
                    new = c.again() if c.again is not None else self.spawn(c.name, c.args)
                    new.restarts = c.restarts

    def _revive_redis(self) -> None:
        """The embedded Redis died on its own (crashed, OOM-killed): start it again on its port,
        password and data. Its append-only file keeps what was fsynced (`broker.fsync`); the
        scheduler rebuilds its state from it and workers and clients reconnect, as after any
        Redis restart. Without this every component would wait for a server nobody starts."""
        r = self.redis
        if r is None or self._redis_given_up or not r.exited():
            return
        if not kids.may_restart("embedded redis", self._redis_restarts, self.max_restarts_per_min):
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
        log_path = kids.log_path(self.state_dir, name)
        # the child arms its parent-death signal against this pid first thing (cli.main)
        env = dict(
            os.environ,
            TANGRAM_BROKER_URL=self.role_url(name),
            PYTHONUNBUFFERED="1",
            **{lifeline.PARENT_ENV: str(os.getpid())},
        )
        cmd = [sys.executable, "-m", "tangram_celery.cli", *args, "--config", str(self.config_path)]
        self.children[name] = Child(name, kids.popen(cmd, log_path, env), log_path, args)
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
        port = last_http_port(self.cfg, self.state_dir)
        if port:  # tried first: taken, the server takes a free one
            args += ["--prefer-port", str(port)]
        self.spawn("http", args)
        return True

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
        cmd, extra = flower_command(
            self.role_url("flower"), port, "127.0.0.1", self.flower_auth, pool_queues(self.cfg)
        )
        log_path = kids.log_path(self.state_dir, "flower")
        proc = kids.popen(lifeline.wrapper_argv(cmd, os.getpid()), log_path, dict(os.environ, **extra))
        child = Child("flower", proc, log_path, again=lambda: self._spawn_flower(port))
        self.children["flower"] = child
        return child

    def wait_ready(self, timeout_s: float = 60.0, progress: bool = True) -> None:
        """Wait until the scheduler published its pools and every worker answers a ping."""
        expected = {n.split("worker-", 1)[1] for n in self.children if n.startswith("worker-")}
        wait_ready(self.url, expected, self.check_alive, self.state_dir / "logs", timeout_s, progress)

    def check_alive(self) -> None:
        kids.check_alive(self.children.values())

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
            return kids.signal_child(self.children[name], sig)

    def stop(self) -> None:
        """Stop every child (SIGTERM, SIGKILL after 15 s) and the embedded Redis (idempotent)."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        kids.stop_all(list(self.children.values()))
        self.children.clear()
        if self.redis is not None:
            with self._lock:  # not while the supervisor restarts it
                self.redis.stop()
            (self.state_dir / URL_FILE).unlink(missing_ok=True)
            for role in self.role_urls:
                (self.state_dir / SECRETS_DIR / f"{role}.url").unlink(missing_ok=True)
        (self.state_dir / "http.url").unlink(missing_ok=True)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_config(cfg: TangramConfig, path: Path) -> Path:
    """Write `cfg` as YAML to `path`, where the deployment's children read it."""
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path
