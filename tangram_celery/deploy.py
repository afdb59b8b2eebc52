"""Start and stop a whole local deployment: embedded Redis, scheduler, one worker per pool, Flower.

Used by `tangram up`, `tangram demo` and the integration tests. Every child is a real process
started here and stopped here by its pid.
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
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tangram_celery.broker import URL_FILE, EmbeddedRedis, write_url
from tangram_celery.config import TangramConfig
from tangram_celery.errors import TangramError
from tangram_celery.store import Store, redact

log = logging.getLogger("tangram.deploy")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)  # monotonic times of restarts


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
    max_restarts_per_min: int = 5
    metrics_ports: dict[str, int] = field(default_factory=dict)
    _supervisor: threading.Thread | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def state_dir(self) -> Path:
        return Path(self.cfg.state_dir)

    def start(self, progress: bool = True) -> Deployment:
        say = print if progress else log.info
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.broker.url == "embedded":
            say("starting embedded redis ...")
            self.redis = EmbeddedRedis(
                self.state_dir / "redis",
                fsync=self.cfg.broker.fsync,
                maxmemory_mb=self.cfg.broker.maxmemory_mb,
            ).start()
            self.url = self.redis.url
        else:
            self.url = self.cfg.broker.url
            Store(self.url).ping()
        write_url(self.state_dir, self.url)
        say(f"broker: {redact(self.url)}")
        self.spawn("scheduler", ["scheduler"])
        for n in self.cfg.nodes.cpu:
            self.spawn(f"worker-cpu-{n.name}", ["worker", "cpu", "--node", n.name])
        for a in self.cfg.apis:
            self.spawn(f"worker-api-{a.name}", ["worker", "api", "--name", a.name])
        for g in self.cfg.nodes.gpu:
            if any(m.backend != "rule" for m in self.cfg.reward_models):
                self.spawn(f"worker-gpu-{g.name}", ["worker", "gpu", "--node", g.name])
        if self.with_flower:
            self._start_flower()
        self.wait_ready(progress=progress)
        self._supervisor = threading.Thread(target=self._supervise, name="tangram-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def _supervise(self, every_s: float = 0.5) -> None:
        """Restart children that exit (crash, kill, stuck-consumer exit), like a process manager."""
        while not self._stopping.wait(every_s):
            with self._lock:
                for c in list(self.children.values()):
                    if c.proc.poll() is None or not c.args:
                        continue
                    now = time.monotonic()
                    c.restarts = [t for t in c.restarts if now - t < 60] + [now]
                    if len(c.restarts) > self.max_restarts_per_min:
                        log.error(
                            "%s keeps exiting (%d restarts in 60 s); giving up", c.name, len(c.restarts)
                        )
                        c.args = []
                        continue
                    log.warning("%s exited with %s; restarting", c.name, c.proc.returncode)
                    new = self.spawn(c.name, c.args)
                    new.restarts = c.restarts

    def spawn(self, name: str, args: list[str]) -> Child:
        """Start `tangram <args>` as a child process logging to <state_dir>/logs/<name>.log.

        With metrics enabled, the child serves Prometheus metrics on a free port, kept across
        restarts and listed in <state_dir>/metrics.json.
        """
        if self.cfg.metrics.enabled and "--metrics-port" not in args:
            from tangram_celery.broker import _free_port
            from tangram_celery.metrics import write_targets

            self.metrics_ports[name] = _free_port()
            args = [*args, "--metrics-port", str(self.metrics_ports[name])]
            write_targets(self.state_dir, self.metrics_ports)
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{name}.log"
        env = dict(os.environ, TANGRAM_BROKER_URL=self.url, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "tangram_celery.cli", *args, "--config", str(self.config_path)]
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.children[name] = Child(name, proc, log_path, args)
        return self.children[name]

    def _start_flower(self) -> None:
        from tangram_celery.broker import _free_port

        port = self.cfg.flower.port or _free_port()
        password = self.cfg.flower.password or secrets.token_urlsafe(12)
        self.flower_auth = (self.cfg.flower.user, password)
        self.flower_url = f"http://127.0.0.1:{port}"
        logs = self.state_dir / "logs"
        cmd, extra = flower_command(self.url, port, "127.0.0.1", self.flower_auth)
        env = dict(os.environ, **extra)
        with open(logs / "flower.log", "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.children["flower"] = Child("flower", proc, logs / "flower.log")

    def wait_ready(self, timeout_s: float = 60.0, progress: bool = True) -> None:
        """Wait until the scheduler published its pools and every worker answers a ping."""
        store = Store(self.url)
        expected = {n.split("worker-", 1)[1] for n in self.children if n.startswith("worker-")}
        deadline = time.monotonic() + timeout_s
        from tangram_celery.app import make_app

        app = make_app(self.url)
        seen: set[str] = set()
        while time.monotonic() < deadline:
            self.check_alive()
            if store.published_config() is not None:
                replies = app.control.ping(timeout=0.5) or []
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

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Signal one child (fault injection) and reap it; the supervisor restarts it. Returns its pid."""
        with self._lock:
            c = self.children[name]
            if c.proc.poll() is None:
                os.killpg(c.proc.pid, sig)
                c.proc.wait(timeout=30)
            return c.proc.pid

    def stop(self) -> None:
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
            self.redis.stop()
            (self.state_dir / URL_FILE).unlink(missing_ok=True)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_config(cfg: TangramConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


def flower_command(
    broker_url: str, port: int, address: str, auth: tuple[str, str]
) -> tuple[list[str], dict[str, str]]:
    """Flower on `address`:`port` with basic auth always on: (argv, extra environment).

    The broker URL and the credentials go through the environment (Celery's BROKER_URL,
    Flower's FLOWER_BASIC_AUTH), so that no password shows in the process list.
    """
    argv = [sys.executable, "-m", "celery", "flower", f"--port={port}", f"--address={address}"]
    env = {
        "BROKER_URL": broker_url,
        "FLOWER_BASIC_AUTH": f"{auth[0]}:{auth[1]}",
        "FLOWER_UNAUTHENTICATED_API": "",
        "FLOWER_INSPECT_TIMEOUT": "5000",  # ms; the 1 s default misses workers on a busy host
    }
    return argv, env
