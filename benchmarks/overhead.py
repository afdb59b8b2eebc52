"""What the Tangram path costs on top of plain Celery, and the scheduler's dispatch rate.

1. Latency: a no-op round trip with one in flight, side by side on the same Redis:
   plain Celery (send_task -> worker -> result backend -> .get()) vs Tangram
   (client -> intake -> scheduler -> Celery queue -> worker -> result). Target: median added <= 2 ms.
   Interleaved with them, the same Tangram round trip by a named tenant's client (its own Redis
   user, intake and keys; issue 37): tenants add at most 0.2 ms.
2. Throughput: the scheduler's own intake + dispatch rate with no worker consuming
   (actions pre-submitted, then the scheduler loop is timed). Target: >= 2,000 actions/s. It is
   measured twice: every action the default tenant's, then spread over three named tenants.

Run: .venv/bin/python benchmarks/overhead.py [--n 400] [--burst 20000]
Writes benchmarks/results/overhead.json and overhead.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, percentile, write_json
from scheduler.service import SchedulerService
from tangram_celery import ApiAction, TangramClient
from tangram_celery.common.config import parse_config
from tangram_celery.deploy import Deployment, write_config
from tangram_celery.testing import tenant_url
from tangram_celery.transport.app import TASK_NOOP, make_app
from tangram_celery.transport.broker import EmbeddedRedis


def _config(tmp: Path, url: str, cap: int) -> object:
    return parse_config(
        {
            "broker": {"url": url},
            "state_dir": str(tmp / "state"),
            "apis": [{"name": "echo", "handler": "tangram_celery.apis.builtin:echo", "max_concurrency": cap}],
        }
    )


def latency(tmp: Path, url: str, n: int) -> dict[str, float]:
    cfg = _config(tmp, url, 64)
    path = write_config(cfg, tmp / "lat.yaml")  # type: ignore[arg-type]
    dep = Deployment(cfg, path, with_flower=False)  # type: ignore[arg-type]
    dep.start(progress=False)
    try:
        app = make_app(url)
        client = TangramClient(url)
        tenant = TangramClient(tenant_url(url, "lat"))
        plain: list[float] = []
        tangram: list[float] = []
        named: list[float] = []
        for i in range(n + 20):  # interleaved, so machine noise hits all three alike
            t0 = time.perf_counter()
            app.send_task(TASK_NOOP, args=[i], queue="tangram.api.echo").get(timeout=30)
            t1 = time.perf_counter()
            client.submit(ApiAction(trajectory_id="lat", api="echo", request={"i": i})).result(timeout=30)
            t2 = time.perf_counter()
            tenant.submit(ApiAction(trajectory_id="lat", api="echo", request={"i": i})).result(timeout=30)
            t3 = time.perf_counter()
            if i >= 20:  # warm-up excluded
                plain.append((t1 - t0) * 1000)
                tangram.append((t2 - t1) * 1000)
                named.append((t3 - t2) * 1000)
        client.close()
        tenant.close()
    finally:
        dep.stop()
    return {
        "plain_celery_p50_ms": statistics.median(plain),
        "tangram_p50_ms": statistics.median(tangram),
        "added_p50_ms": statistics.median(tangram) - statistics.median(plain),
        "tenant_p50_ms": statistics.median(named),
        "tenant_added_p50_ms": statistics.median(named) - statistics.median(plain),
        "tenant_extra_p50_ms": statistics.median(named) - statistics.median(tangram),
        "plain_celery_p99_ms": percentile(plain, 0.99),
        "tangram_p99_ms": percentile(tangram, 0.99),
        "tenant_p99_ms": percentile(named, 0.99),
        "samples": n,
    }


def dispatch_rate(tmp: Path, url: str, burst: int, tenants: int = 0) -> dict[str, float]:
    """Intake + dispatch of `burst` pre-submitted actions: the default tenant's, or spread
    round robin over `tenants` named tenants (each its own client, intake and keys)."""
    import redis

    redis.Redis.from_url(url).flushdb()
    urls = [tenant_url(url, f"burst{k}") for k in range(tenants)] or [url]
    cfg = _config(tmp, url, 10**9)
    svc = SchedulerService(cfg, url)  # type: ignore[arg-type]
    svc.start()
    clients = [TangramClient(u) for u in urls]
    t0 = time.perf_counter()
    for lo in range(0, burst, 1000):
        for k, client in enumerate(clients):
            client.submit_many(
                ApiAction(trajectory_id=f"t{i % 100}", api="echo", request={"i": i})
                for i in range(lo, min(burst, lo + 1000))
                if i % len(clients) == k
            )
    t_submit = time.perf_counter() - t0
    t0 = time.perf_counter()
    while svc.dispatched_total < burst:
        svc.step(block_ms=100)
    t_dispatch = time.perf_counter() - t0
    for client in clients:
        client.close()
    svc.stop()
    return {
        "actions": burst,
        "tenants": tenants,
        "submit_rate_per_s": burst / t_submit,
        "dispatch_rate_per_s": burst / t_dispatch,
    }


def plot(res: dict[str, dict[str, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    lat = res["latency"]
    a.bar(
        ["plain Celery", "Tangram", "Tangram,\nnamed tenant"],
        [lat["plain_celery_p50_ms"], lat["tangram_p50_ms"], lat["tenant_p50_ms"]],
        color=["grey", "tab:blue", "tab:cyan"],
    )
    a.set_ylabel("median round trip (ms)")
    a.set_title(f"no-op latency (+{lat['added_p50_ms']:.2f} ms)")
    rate = res["throughput"]
    rate3 = res["throughput_tenants"]
    b.bar(
        ["intake (submit)", "scheduler dispatch", "dispatch,\n3 tenants"],
        [rate["submit_rate_per_s"], rate["dispatch_rate_per_s"], rate3["dispatch_rate_per_s"]],
    )
    b.axhline(2000, color="red", ls="--", label="target 2,000/s")
    b.set_ylabel("actions / s")
    b.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=400, help="latency samples")
    ap.add_argument("--burst", type=int, default=20000, help="actions for the dispatch-rate run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with EmbeddedRedis(tmp / "redis") as server:
            print("measuring latency ...", flush=True)
            lat = latency(tmp, server.url, args.n)
            print("measuring dispatch rate ...", flush=True)
            thr = dispatch_rate(tmp, server.url, args.burst)
            print("measuring dispatch rate over three tenants ...", flush=True)
            thr3 = dispatch_rate(tmp, server.url, args.burst, tenants=3)
    policy = _config(Path("."), "redis://unused", 1).scheduler.policy  # type: ignore[attr-defined]
    res = {
        "policy": {"name": policy, "params": {}},
        "latency": lat,
        "throughput": thr,
        "throughput_tenants": thr3,
    }
    write_json("overhead", res)
    plot(res, RESULTS / "overhead.png")
    print(
        f"no-op round trip, median: plain Celery {lat['plain_celery_p50_ms']:.2f} ms, "
        f"Tangram {lat['tangram_p50_ms']:.2f} ms -> added {lat['added_p50_ms']:.2f} ms (target <= 2 ms)"
    )
    print(
        f"named tenant: {lat['tenant_p50_ms']:.2f} ms -> {lat['tenant_extra_p50_ms']:+.2f} ms over the "
        "default tenant's (target <= 0.2 ms)"
    )
    print(
        f"scheduler intake+dispatch with workers paused: {thr['dispatch_rate_per_s']:.0f} actions/s "
        f"(target >= 2,000); client submit {thr['submit_rate_per_s']:.0f} actions/s; over three "
        f"tenants {thr3['dispatch_rate_per_s']:.0f} actions/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
