"""`tangram nodes`: the CPU/GPU nodes with their state and load, as a table or JSON.

It reads what the workers registered (`tangram:nodes`), their heartbeats (a node whose record
says it serves while no worker of it beats is `lost`) and the load the scheduler publishes with
each pass (`tangram:node_load`: units in use, running actions, pinned trajectories). A node the
config declares whose worker never registered shows as `unregistered` (or `ready` while a
worker of it beats: one started before nodes registered).
"""

from __future__ import annotations

import json
import time
from typing import Any

from tangram_celery.common.node_record import NodeLoad, NodeRecord, live_pools, view_state
from tangram_celery.store import Store

LOAD_STALE_S = 10.0  # a load older than this (no scheduler running) is not shown


def node_rows(store: Store, dead_after_s: float = 5.0, now_s: float | None = None) -> list[dict[str, Any]]:
    """One row per node, sorted by kind and name."""
    server_now, workers = store.workers()
    live = live_pools(server_now, workers, dead_after_s)
    records, loads = store.node_records(), store.node_loads()
    now_s = time.time() if now_s is None else now_s
    rows = []
    for name in sorted(set(records) | set(loads)):
        rec, load = records.get(name), loads.get(name)
        if load is not None and now_s - load.at_s > LOAD_STALE_S:
            load = None
        rows.append(_row(name, rec, load, live))
    return sorted(rows, key=lambda r: (r["kind"], r["node"]))


def _row(name: str, rec: NodeRecord | None, load: NodeLoad | None, live: set[str]) -> dict[str, Any]:
    kind = rec.kind if rec is not None else (load.kind if load is not None else "cpu")
    if rec is not None:
        state = str(view_state(rec, live))
    else:
        state = "ready" if f"{kind}:{name}" in live else "unregistered"
    row: dict[str, Any] = {"node": name, "kind": kind, "state": state}
    if rec is not None:
        row.update(
            declared=rec.declared,
            worker=rec.worker,
            host=rec.host,
            memory_mb=rec.memory_mb,
            registered_s=rec.registered_s,
        )
        if kind == "cpu":
            row.update(cores=rec.cores, numa=[list(g) for g in rec.numa], languages=list(rec.languages))
        else:
            row.update(gpus=rec.num_gpus, gpu_memory_mb=rec.gpu_memory_mb)
    if load is not None:
        row["load"] = {
            "units": load.units,
            "in_use": load.in_use,
            "running": load.running,
            "pinned": load.pinned,
            "scheduler_state": load.state,
        }
        row.setdefault("cores" if kind == "cpu" else "gpus", load.units)
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width table (`-`: not known)."""
    head = ("NODE", "KIND", "STATE", "UNITS", "MEMORY", "IN USE", "RUNNING", "PINNED", "WORKER")
    lines = [head]
    for r in rows:
        load = r.get("load") or {}
        if r["kind"] == "cpu":
            units = f"{r['cores']} cores" if "cores" in r else "-"
            memory = f"{r['memory_mb']} MiB" if "memory_mb" in r else "-"
        else:
            units = f"{r['gpus']} GPUs" if "gpus" in r else "-"
            memory = f"{r['gpu_memory_mb']} MiB/GPU" if "gpu_memory_mb" in r else "-"
        used = f"{load['in_use']}/{load['units']}" if load else "-"
        lines.append(
            (
                r["node"],
                r["kind"],
                r["state"],
                units,
                memory,
                used,
                str(load.get("running", "-")),
                str(load.get("pinned", "-")) if r["kind"] == "cpu" else "-",
                r.get("worker", "-") or "-",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def show(store: Store, as_json: bool) -> str:
    rows = node_rows(store)
    if as_json:
        return json.dumps(rows, indent=2)
    return format_table(rows) if rows else "no nodes registered (is a worker running?)"
