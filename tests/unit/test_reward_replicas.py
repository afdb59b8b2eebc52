"""ReplicaManager acting on a fake controller: load on demand, cache, LRU eviction, failures."""

from __future__ import annotations

import threading

import pytest

from reward_servers.errors import ModelLoadFailed, NoCapacity
from reward_servers.placement import ScalingPolicy
from reward_servers.replicas import ReplicaManager
from reward_servers.testing import FakeController


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def manager(ctl: FakeController, **kw: object) -> ReplicaManager:
    mem = {"a": 1024, "b": 1024, "c": 1024, "big": 2048}
    return ReplicaManager(ctl, 2, 2048, mem, clock=Clock(), **kw)  # type: ignore[arg-type]


def test_first_use_loads_then_stays_cached() -> None:
    """Given a cold service, when leased twice, then Triton loads it once and the second lease is a hit."""
    ctl = FakeController()
    m = manager(ctl)
    with m.lease("a", 1, (0,)) as r:
        assert r.name == "a__dop1__g0" and r.in_flight == 1
    with m.lease("a", 1, (0,)):
        pass
    assert ctl.calls == [("load", "a__dop1__g0")]
    assert m.stats["hits"] == 1 and m.resident() == {(0,): ["a__dop1"]}


def test_full_gpu_evicts_least_recently_used() -> None:
    """Given GPU 0 holding a then b, when c needs GPU 0, then a (LRU) is unloaded and b stays."""
    ctl = FakeController()
    m = manager(ctl)
    for name in ("a", "b", "c"):
        m.preload(name, 1, (0,))
    assert ("unload", "a__dop1__g0") in ctl.calls
    assert ctl.loaded == {"b__dop1__g0", "c__dop1__g0"}
    assert m.snapshot()["gpu_used_mb"] == [2048, 0]


def test_in_flight_replica_survives_pressure() -> None:
    """Given a leased replica filling GPU 0, when another model needs GPU 0, then it waits and gives up."""
    ctl = FakeController()
    m = manager(ctl)
    held = m.acquire("big", 1, (0,))
    with pytest.raises(NoCapacity):
        m.acquire("a", 1, (0,), timeout_s=0.0)
    assert "big__dop1__g0" in ctl.loaded
    m.release(held)
    m.preload("a", 1, (0,))
    assert ctl.loaded == {"a__dop1__g0"}


def test_failed_load_is_reported_and_forgotten() -> None:
    """Given a replica whose load fails, when leased, then ModelLoadFailed is raised and no memory is held."""
    ctl = FakeController()
    ctl.fail_load("a__dop1__g0")
    m = manager(ctl)
    with pytest.raises(ModelLoadFailed, match="injected"):
        m.acquire("a", 1, (0,))
    assert m.snapshot()["replicas"] == [] and m.stats["load_failures"] == 1


def test_concurrent_leases_share_one_load() -> None:
    """Given a slow load, when four threads lease the same service, then it is loaded once."""
    ctl = FakeController(load_delay_s=0.2)
    m = manager(ctl)
    names: list[str] = []

    def work() -> None:
        with m.lease("a", 1) as r:
            names.append(r.name)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [c for c in ctl.calls if c[0] == "load"] == [("load", "a__dop1__g0")]
    assert len(names) == 4


def test_scale_grows_and_shrinks() -> None:
    """Given a hot service, when scaled with a long queue then with none, then it grows to GPU 1 and shrinks."""
    ctl = FakeController()
    m = manager(ctl, policy=ScalingPolicy(scale_up_queue_per_replica=8, idle_timeout_s=5))
    m.preload("a", 1, (0,))
    grown = m.scale({("a", 1): 50})
    assert [p.replica for p in grown.grow] == ["a__dop1__g1"] and ctl.loaded == {"a__dop1__g0", "a__dop1__g1"}
    for _ in range(10):
        m.clock()
    shrunk = m.scale({})
    assert len(shrunk.shrink) == 1 and len(ctl.loaded) == 1


def test_reset_after_restart_forgets_residency() -> None:
    """Given cached replicas, when the server restarts, then the next lease loads again."""
    ctl = FakeController()
    m = manager(ctl)
    m.preload("a", 1, (0,))
    ctl.set_unhealthy()
    ctl.set_ready()
    m.reset()
    m.preload("a", 1, (0,))
    assert [c for c in ctl.calls if c[0] == "load"] == [("load", "a__dop1__g0")] * 2


def test_warm_loads_ahead_of_requests_and_counts_apart_from_restores() -> None:
    """Given a warm-up plan, when it is carried out, then every planned replica is loaded,
    counted as a warm load (not an on-demand load), and the first request is a cache hit."""
    ctl = FakeController()
    m = manager(ctl)
    plan = m.plan_warm([("a", 1), ("b", 1)])
    assert [m.warm(p) for p in plan] == [True, True, True, True]
    assert m.stats["warm_loads"] == 4 and m.stats["loads"] == 0
    with m.lease("a", 1, (1,)):
        pass
    assert m.stats["hits"] == 1 and m.stats["loads"] == 0
    assert m.resident() == {(0,): ["a__dop1", "b__dop1"], (1,): ["b__dop1", "a__dop1"]}


def test_warm_gives_way_to_requests_that_came_first() -> None:
    """Given a plan made on an empty node, when requests loaded other services meanwhile, then
    warming skips what no longer fits instead of evicting them, and skips what is already there."""
    ctl = FakeController()
    m = manager(ctl)
    plan = m.plan_warm([("a", 1)])  # a on GPU 0, then on GPU 1
    with m.lease("big", 1, (0,)):
        pass
    with m.lease("a", 1, (1,)):
        pass
    assert [m.warm(p) for p in plan] == [False, False]
    assert ("unload", "big__dop1__g0") not in ctl.calls and m.stats["warm_loads"] == 0


def test_request_during_a_warm_load_waits_for_it_instead_of_loading_again() -> None:
    """Given a warm load in progress, when a request for the same replica arrives, then it waits
    for that load and Triton loads the replica once."""
    ctl = FakeController(load_delay_s=0.3)
    m = manager(ctl)
    (first, *_) = m.plan_warm([("a", 1)])
    warming = threading.Thread(target=m.warm, args=(first,))
    warming.start()
    threading.Event().wait(0.05)
    with m.lease("a", 1, (0,)) as r:
        assert r.state == "ready"
    warming.join()
    assert ctl.calls.count(("load", "a__dop1__g0")) == 1 and m.stats["loads"] == 0
