"""Host-side cgroup control for sandboxes, on cgroup v1 or v2.

Both backends use it: the namespace backend creates one cgroup set per trajectory; the Docker
backend opens the container's own cgroups (found from its init pid) to bind cores without a
`docker update` round trip and to read the OOM and pids-limit counters that decide statuses.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("cpu", "cpuset", "memory", "pids")
# v1 only: CPU time used (`cpuacct.usage`), joined where mounted and writable (v2's `cpu.stat`
# has it): what a time sharer's run is learned by (`counters()["cpu_us"]`)
V1_ACCOUNTING = "cpuacct"
CPU_PERIOD_US = 100_000
# the default CPU weight of a cgroup and its bounds: v2 `cpu.weight`, v1 `cpu.shares`
CPU_WEIGHT = {2: (100, 1, 10_000), 1: (1024, 2, 262_144)}


def version(root: Path = ROOT) -> int | None:
    """2 for a writable unified hierarchy with our controllers, 1 for writable v1, else None."""
    ctl = root / "cgroup.controllers"
    if ctl.exists():
        have = set(ctl.read_text().split())
        return 2 if {"cpu", "cpuset", "memory", "pids"} <= have and os.access(root, os.W_OK) else None
    if all((root / c).is_dir() and os.access(root / c, os.W_OK) for c in V1_CONTROLLERS):
        return 1
    return None


@dataclass
class CgroupSet:
    """The cgroup directories of one sandbox: one per controller on v1, one shared on v2."""

    version: int
    dirs: dict[str, Path] = field(default_factory=dict)
    _fds: dict[tuple[str, str], int] = field(default_factory=dict, repr=False, compare=False)

    def _file(self, controller: str, name: str) -> Path:
        return self.dirs[controller] / name

    def _write(self, controller: str, name: str, value: str) -> None:
        self._file(controller, name).write_text(value)

    def _read(self, controller: str, name: str, keep: bool = False) -> str:
        """The file's text ("" when it cannot be read). With `keep`, through a descriptor kept
        open and read from offset 0 each time: a counter file shows its current value at every
        read from 0, and the counters are read twice per action, where an open and a close of a
        cgroup path cost about 5 us more. Not for `cgroup.procs`: v1 keeps an open file's pid
        list for a second."""
        key = (controller, name)
        fd = self._fds.get(key) if keep else None
        try:
            if fd is None:
                fd = os.open(str(self._file(controller, name)), os.O_RDONLY | os.O_CLOEXEC)
                if not keep:
                    try:
                        return os.read(fd, 1 << 16).decode()
                    finally:
                        os.close(fd)
                kept = self._fds.setdefault(key, fd)
                if kept != fd:  # another thread opened it first
                    os.close(fd)
                    fd = kept
            return os.pread(fd, 1 << 16, 0).decode()
        except (OSError, KeyError):
            return ""

    def close(self) -> None:
        """Close the descriptors `_read` keeps (reading again reopens them)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit, `os` may be gone already
            pass

    # -- creation ------------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, root: Path = ROOT) -> CgroupSet:
        """Create `tangram/<name>` under every needed controller (parents set up as needed)."""
        ver = version(root)
        if ver is None:
            raise OSError("no writable cgroup hierarchy with cpu, cpuset, memory and pids")
        cg = cls(ver)
        if ver == 2:
            parent = root / "tangram"
            parent.mkdir(exist_ok=True)
            _enable_v2(root, parent)
            d = parent / name
            d.mkdir(exist_ok=True)
            cg.dirs = {c: d for c in V1_CONTROLLERS}
            return cg
        for c in V1_CONTROLLERS:
            parent = root / c / "tangram"
            parent.mkdir(exist_ok=True)
            d = parent / name
            d.mkdir(exist_ok=True)
            cg.dirs[c] = d
        acct = root / V1_ACCOUNTING
        if acct.is_dir() and os.access(acct, os.W_OK):
            try:  # optional: without it, nothing reports CPU time
                (acct / "tangram").mkdir(exist_ok=True)
                (acct / "tangram" / name).mkdir(exist_ok=True)
                cg.dirs[V1_ACCOUNTING] = acct / "tangram" / name
            except OSError as e:
                log.debug("no %s cgroup for %s: %s", V1_ACCOUNTING, name, e)
        for d in (cg.dirs["cpuset"].parent, cg.dirs["cpuset"]):
            for f in ("cpuset.cpus", "cpuset.mems"):  # v1 cpusets start empty
                if not (d / f).read_text().strip():
                    (d / f).write_text((d.parent / f).read_text().strip())
        return cg

    @classmethod
    def existing(cls, name: str, root: Path = ROOT) -> CgroupSet | None:
        """The set `tangram/<name>` if it exists (not created), e.g. to sweep it."""
        ver = version(root)
        if ver == 2:
            d = root / "tangram" / name
            return cls(2, {c: d for c in V1_CONTROLLERS}) if d.is_dir() else None
        if ver == 1:
            dirs = {c: root / c / "tangram" / name for c in (*V1_CONTROLLERS, V1_ACCOUNTING)}
            found = {c: d for c, d in dirs.items() if d.is_dir()}
            if found:
                # controllers whose directory is already gone stay out of destroy()
                out = {c: found.get(c, found[next(iter(found))]) for c in V1_CONTROLLERS}
                if V1_ACCOUNTING in found:
                    out[V1_ACCOUNTING] = found[V1_ACCOUNTING]
                return cls(1, out)
        return None

    @classmethod
    def of_pid(cls, pid: int, root: Path = ROOT) -> CgroupSet | None:
        """The cgroups process `pid` lives in (e.g. a container's init), or None if unreadable."""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        v1: dict[str, Path] = {}
        unified: Path | None = None
        for line in lines:
            _, ctrls, rel = line.split(":", 2)
            if ctrls == "":
                unified = root / rel.lstrip("/")
            for c in ctrls.split(","):
                if c in V1_CONTROLLERS or c == V1_ACCOUNTING:
                    v1[c] = root / c / rel.lstrip("/")
        if all(c in v1 and v1[c].is_dir() for c in V1_CONTROLLERS):
            return cls(1, v1)
        if unified is not None and (unified / "memory.events").exists():
            return cls(2, {c: unified for c in V1_CONTROLLERS})
        return None

    # -- limits ----------------------------------------------------------------------------------
    def add_self(self) -> None:
        """Move the calling process into this set (used in a child before exec)."""
        for d in set(self.dirs.values()):
            (d / "cgroup.procs").write_text(str(os.getpid()))

    def set_memory(self, memory_mb: int) -> None:
        """Hard memory limit in MiB (swap off where the kernel lets us)."""
        limit_b = str(memory_mb * 1024 * 1024)
        if self.version == 2:
            self._write("memory", "memory.max", limit_b)
            if self._file("memory", "memory.swap.max").exists():
                self._write("memory", "memory.swap.max", "0")
        else:
            # v1 insists on limit <= memsw.limit: raise memsw first, lower it last
            names = ["memory.limit_in_bytes"]
            if self._file("memory", "memory.memsw.limit_in_bytes").exists():
                cur = int(self._read("memory", "memory.limit_in_bytes") or 0)
                memsw = "memory.memsw.limit_in_bytes"
                names = [memsw, *names] if int(limit_b) > cur else [*names, memsw]
            for name in names:
                self._write("memory", name, limit_b)

    def set_pids(self, pids_limit: int) -> None:
        self._write("pids", "pids.max", str(pids_limit))

    def bind_cores(self, cores: tuple[int, ...], was: tuple[int, ...] | None = None) -> None:
        """cpuset = `cores`, CFS quota = len(cores) full cores. With `was` (the cores bound
        now), only what changes is written: the quota stays when the count of cores does."""
        cpus = ",".join(str(c) for c in sorted(set(cores)))
        quota_us = len(set(cores)) * CPU_PERIOD_US
        if was is None or set(was) != set(cores):
            self._write("cpuset", "cpuset.cpus", cpus)
        if was is not None and len(set(was)) == len(set(cores)):
            return
        if self.version == 2:
            self._write("cpu", "cpu.max", f"{quota_us} {CPU_PERIOD_US}")
        else:
            self._write("cpu", "cpu.cfs_period_us", str(CPU_PERIOD_US))
            self._write("cpu", "cpu.cfs_quota_us", str(quota_us))

    def set_cpu_weight(self, relative: float | None = None) -> None:
        """CPU weight of the whole set relative to the default (None: the default again), which
        CFS spreads over the cores the set runs on: a time sharer's sandbox beside the action
        that holds its cores (`scheduler.policies.time_share`). v2 `cpu.weight`, v1
        `cpu.shares`, clamped to the kernel's range."""
        default, lo, hi = CPU_WEIGHT[self.version]
        value = default if relative is None else min(hi, max(lo, round(default * relative)))
        self._write("cpu", "cpu.weight" if self.version == 2 else "cpu.shares", str(value))

    def cpu_weight(self) -> float:
        """The set's CPU weight relative to the default (1.0 when unreadable)."""
        raw = self._read("cpu", "cpu.weight" if self.version == 2 else "cpu.shares").strip()
        return int(raw) / CPU_WEIGHT[self.version][0] if raw.isdigit() else 1.0

    def counters(self) -> dict[str, int]:
        """Monotonic counters: `oom_kill` (OOM kills), `pids_max` (forks refused at the limit)
        and, where the kernel accounts it, `cpu_us` (CPU time used, microseconds)."""
        mem = self._read("memory", "memory.events" if self.version == 2 else "memory.oom_control", keep=True)
        pids = self._read("pids", "pids.events", keep=True)
        out = {"oom_kill": _field(mem, "oom_kill"), "pids_max": _field(pids, "max")}
        if self.version == 2:
            stat = self._read("cpu", "cpu.stat", keep=True)
            if stat:
                out["cpu_us"] = _field(stat, "usage_usec")
        elif V1_ACCOUNTING in self.dirs:
            used_ns = self._read(V1_ACCOUNTING, "cpuacct.usage", keep=True).strip()
            if used_ns.isdigit():
                out["cpu_us"] = int(used_ns) // 1000
        return out

    def procs(self) -> list[int]:
        return [int(p) for p in self._read("pids", "cgroup.procs").split()]

    def destroy(self, timeout_s: float = 5.0) -> None:
        """Kill whatever is left inside and remove the directories."""
        deadline = time.monotonic() + timeout_s
        kill_file = self._file("pids", "cgroup.kill")
        while self.procs() and time.monotonic() < deadline:
            if self.version == 2 and kill_file.exists():
                kill_file.write_text("1")
            else:
                for pid in self.procs():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.01)
        self.close()
        for d in set(self.dirs.values()):
            try:
                d.rmdir()
            except OSError as e:
                log.warning("cannot remove cgroup %s: %s", d, e)


def children(prefix: str, root: Path = ROOT) -> list[str]:
    """Names of the sandbox cgroups `tangram/<name>` whose name starts with `prefix` (any
    controller: a v1 set half removed by a killed worker still shows)."""
    ver = version(root)
    parents = (
        [root / "tangram"] if ver == 2 else [root / c / "tangram" for c in (*V1_CONTROLLERS, V1_ACCOUNTING)]
    )
    names: set[str] = set()
    for parent in parents:
        try:
            names.update(d.name for d in parent.iterdir() if d.is_dir() and d.name.startswith(prefix))
        except OSError:
            continue
    return sorted(names)


def _field(text: str, key: str) -> int:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


def _enable_v2(root: Path, parent: Path) -> None:
    """Turn on the controllers we need for `parent`'s children (v2 needs them delegated)."""
    for d in (root, parent):
        try:
            (d / "cgroup.subtree_control").write_text("+cpu +cpuset +memory +pids")
        except OSError as e:
            log.debug("subtree_control on %s: %s", d, e)
