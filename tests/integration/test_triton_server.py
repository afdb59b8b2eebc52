"""Health and failure of the real tritonserver: failed loads, crashes, cached vs cold services."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest


def test_failed_model_load_is_reported(reward_service: Any) -> None:
    """Given a model whose directory does not exist, when scored, then ModelLoadFailed says why and the server lives on."""
    from reward_servers.errors import ModelLoadFailed

    with pytest.raises(ModelLoadFailed, match=r"config\.json") as e:
        reward_service.score("broken", [{"response": "x"}], chunk=(1,))
    assert e.value.retryable
    assert reward_service.health()["alive"]
    assert all(r["name"] != "broken__dop1__g1" for r in reward_service.health()["replicas"])


def test_cached_service_is_not_reloaded(reward_service: Any) -> None:
    """Given a scored service, when scored again on the same chunk, then it is a cache hit, not a load."""
    reward_service.score("rm", [{"response": "warm"}], chunk=(0,))
    before = dict(reward_service.health()["stats"])
    reward_service.score("rm", [{"response": "again"}], chunk=(0,))
    after = reward_service.health()["stats"]
    assert after["loads"] == before["loads"] and after["hits"] == before["hits"] + 1


def test_crash_is_detected_restarted_and_retried(reward_service: Any) -> None:
    """Given a killed tritonserver, when scoring, then the server restarts and the request still succeeds."""
    restarts = reward_service.health()["restarts"]
    os.kill(reward_service.server.info.pid, signal.SIGKILL)
    out = reward_service.score("rm", [{"response": "after the crash"}], chunk=(0,))
    assert "score" in out[0]
    health = reward_service.health()
    assert health["alive"] and health["restarts"] == restarts + 1


def test_call_during_a_monitor_restart_waits_for_the_replica_table(
    reward_service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given the monitor mid-recovery (new server up, old replica table not yet cleared), when
    scoring, then the call waits for the recovery and loads the replica on the new server instead
    of failing with Triton's 404 for the dead server's replica."""
    import time

    reward_service.score("rm", [{"response": "warm"}], chunk=(0,))
    manager, reset = reward_service.manager, reward_service.manager.reset

    def slow_reset() -> None:  # widens the window the CI run hit by chance
        time.sleep(1.5)
        reset()

    monkeypatch.setattr(manager, "reset", slow_reset)
    restarts, old_url = reward_service.server.restarts, reward_service.controller.url
    os.kill(reward_service.server.info.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while reward_service.controller.url == old_url or reward_service.server.restarts == restarts:
        assert time.monotonic() < deadline, "the monitor did not restart the server"
        time.sleep(0.02)
    out = reward_service.score("rm", [{"response": "during the recovery"}], chunk=(0,))
    assert "score" in out[0]
    assert reward_service.health()["restarts"] == restarts + 1


def test_reported_execution_time_leaves_out_the_replica_load(
    reward_service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a replica load that takes at least 1 s, when a call has to load its replica, then
    `score_timed` reports the inference alone (what the scheduler learns durations from), and a
    second call on the loaded replica reports a time of the same kind."""
    import time

    manager = reward_service.manager
    load = manager.controller.load

    def slow_load(name: str) -> None:
        time.sleep(1.0)
        load(name)

    manager.reset()  # forget the replica table: the next call loads its replica again
    monkeypatch.setattr(manager.controller, "load", slow_load)
    loads = manager.stats["loads"]
    t0 = time.monotonic()
    out, exec_s = reward_service.score_timed("rm", [{"response": "cold"}], chunk=(0,))
    wall_s = time.monotonic() - t0
    assert "score" in out[0] and manager.stats["loads"] == loads + 1
    assert wall_s >= 1.0 and 0.0 < exec_s < wall_s - 1.0
    out, warm_s = reward_service.score_timed("rm", [{"response": "warm"}], chunk=(0,))
    assert "score" in out[0] and manager.stats["loads"] == loads + 1 and warm_s > 0.0


def test_an_evicted_replica_comes_back_from_host_memory(reward_service: Any) -> None:
    """Given a replica evicted from GPU 0 by two others (the node's default host tier), when its
    service is called there again, then its weights are restored from host memory: no cold
    load, the same scores, and the instance's control socket is private to this user."""
    import stat

    from scheduler.gpu_cache import Tier

    rows = [{"prompt": "p", "response": "the same input"}]
    first = reward_service.score_traced("rm", rows, chunk=(0,))
    # GPU 0 holds two 1024 MiB replicas: after these two, rm is the least recently used one
    reward_service.score("teacher", [{"prompt": "p", "response": "r"}], chunk=(0,))
    reward_service.score("emb", [{"reference": "a", "response": "b"}], chunk=(0,))
    assert "rm" in reward_service.host_resident_models().get((0,), [])
    assert "rm" not in reward_service.resident_models().get((0,), [])
    loads = reward_service.health()["stats"]["loads"]
    again = reward_service.score_traced("rm", rows, chunk=(0,))
    assert again.tier is Tier.HOST and again.load_s > 0
    assert again.results[0]["score"] == pytest.approx(first.results[0]["score"], abs=1e-6)
    stats = reward_service.health()["stats"]
    assert stats["loads"] == loads and stats["host_restores"] >= 1
    control = reward_service.controller.control
    assert stat.S_IMODE(control.stat().st_mode) == 0o700 and control.stat().st_uid == os.getuid()
    assert list(control.glob("*.sock"))
