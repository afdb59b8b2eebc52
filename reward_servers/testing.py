"""Test helpers for code that drives reward servers: an in-memory controller.

`FakeController` stands in for Triton model control in unit tests (no server needed): it records
every call and can be told to fail loads or restores, or to "crash".
"""

from __future__ import annotations

import threading

from reward_servers.errors import ModelLoadFailed, TritonCrashed


class FakeController:
    """Records load/unload/offload/restore calls; `fail_load(name)`, `fail_restore(name)` and
    `set_unhealthy()` inject failures. `on_host`: loaded replicas whose weights are offloaded."""

    def __init__(self, load_delay_s: float = 0.0) -> None:
        self.loaded: set[str] = set()
        self.on_host: set[str] = set()
        self.calls: list[tuple[str, str]] = []  # ("load" | "unload" | "offload" | "restore", name)
        self.load_delay_s = load_delay_s
        self._failing: set[str] = set()
        self._healthy = True
        self._lock = threading.Lock()

    def fail_load(self, name: str) -> None:
        self._failing.add(name)

    def fail_restore(self, name: str) -> None:
        self._failing.add("restore:" + name)

    def set_unhealthy(self) -> None:
        self._healthy = False
        self.loaded.clear()

    def set_ready(self) -> None:
        self._healthy = True

    def _check(self) -> None:
        if not self._healthy:
            raise TritonCrashed("fake server is down")

    def load(self, name: str) -> None:
        self._check()
        if self.load_delay_s:
            threading.Event().wait(self.load_delay_s)
        with self._lock:
            self.calls.append(("load", name))
            if name in self._failing:
                raise ModelLoadFailed(name, "injected failure")
            self.loaded.add(name)

    def unload(self, name: str) -> None:
        self._check()
        with self._lock:
            self.calls.append(("unload", name))
            self.loaded.discard(name)
            self.on_host.discard(name)

    def offload(self, name: str, instances: int) -> float:
        return self._move("offload", name)

    def restore(self, name: str, instances: int) -> float:
        return self._move("restore", name)

    def _move(self, cmd: str, name: str) -> float:
        self._check()
        with self._lock:
            self.calls.append((cmd, name))
            if name not in self.loaded or (name in self.on_host) != (cmd == "restore"):
                raise ModelLoadFailed(name, f"{cmd}: not in the right place")
            if "restore:" + name in self._failing and cmd == "restore":
                raise ModelLoadFailed(name, "injected restore failure")
            (self.on_host.add if cmd == "offload" else self.on_host.discard)(name)
        return 0.0

    def is_ready(self, name: str) -> bool:
        self._check()
        return name in self.loaded
