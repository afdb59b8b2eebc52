"""Process helpers for the lifecycle tests: descendants by /proc, sandbox cgroups by scope."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.fixtures import common

ROOT = Path(__file__).resolve().parents[2]
NODE = "n0"
GONE_WITHIN_S = 60.0


# -- process helpers ------------------------------------------------------------------------------
def proc_stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def identity(pid: int) -> tuple[int, str] | None:
    """(pid, start time): survives pid reuse checks."""
    st = proc_stat(pid)
    return None if st is None else (pid, st[19])


def running(ident: tuple[int, str]) -> bool:
    st = proc_stat(ident[0])
    return st is not None and st[19] == ident[1] and st[0] not in ("Z", "X")


def status_field(pid: int, name: str) -> list[str]:
    """The values of one line of /proc/<pid>/status (`Uid`, `NSpid`, ...); [] when gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return []
    return next((x.split()[1:] for x in lines if x.startswith(name + ":")), [])


def is_sandbox_runner(pid: int) -> bool:
    """Is `pid` a sandbox's runner: PID 1 of a pid namespace of its own (its NSpid ends in 1;
    the zygote and verifier seed it forks share its command line, not that)?"""
    nspid = status_field(pid, "NSpid")
    return len(nspid) > 1 and nspid[-1] == "1"


def descendants(pid: int) -> set[tuple[int, str]]:
    """Every live descendant of `pid` (by parent links in /proc), as (pid, start time)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = proc_stat(int(entry.name))
            if st is not None:
                parent[int(entry.name)] = int(st[1])
    out: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {c for c, p in parent.items() if p in frontier} - out
        out |= frontier
    return {i for i in (identity(p) for p in out) if i is not None}


def sandbox_cgroups(scope: str) -> list[Path]:
    """This deployment's sandbox cgroup directories (any controller, v1 or v2)."""
    roots = [Path("/sys/fs/cgroup/tangram"), *Path("/sys/fs/cgroup").glob("*/tangram")]
    return [d for r in roots if r.is_dir() for d in r.iterdir() if d.name.startswith(f"{scope}-")]


def cgroup_pids(scope: str) -> set[int]:
    pids: set[int] = set()
    for d in sandbox_cgroups(scope):
        try:
            pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
        except OSError:
            pass
    return pids


def wait_until(what: str, cond: Any, timeout_s: float = GONE_WITHIN_S) -> None:
    common.wait_until(what, cond, timeout_s)


# -- a real `tangram up` ---------------------------------------------------------------------------


def cleanup_scope(scope: str) -> None:
    """Remove what a test's dead worker left (when the test killed its reaper too)."""
    from tangram_celery.sandbox.reaper import remove_cgroups, remove_stage
    from tangram_celery.sandbox.stage import DEFAULT_STAGE_DIR

    remove_cgroups(f"{scope}-")
    for d in (Path(DEFAULT_STAGE_DIR) / scope).glob("*"):
        if d.is_dir():
            remove_stage(d)
