"""TLS across hosts (issue 37): a deployment over rediss:// with a CA and client certificates,
against a real TLS-only redis-server (`tests.fixtures.tls`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis

from tangram_celery import ApiAction, CodeAction
from tangram_celery.common.actions import ActionStatus

CALC = {"name": "calc", "handler": "tangram_celery.apis.builtin:calculator", "max_concurrency": 4}


def _tls(c: dict[str, Path], **over: Path) -> dict[str, str]:
    files = {"ca_file": c["ca"], "cert_file": c["client"], "key_file": c["client_key"], **over}
    return {k: str(v) for k, v in files.items()}


def _refused(url: str) -> BaseException:
    """The error a PING over `url` ends in (the test fails if it is answered)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
    except (redis.ConnectionError, redis.AuthenticationError, OSError) as e:
        return e
    finally:
        client.close()
    raise AssertionError(f"PING over {url} was answered")


def test_a_deployment_runs_actions_over_rediss(tmp_path: Path, tls_redis: Any) -> None:
    """Given a TLS-only Redis that requires client certificates, and a config naming rediss:// with
    broker.tls, when `tangram up`'s stack starts and a TangramClient (sync and asyncio) submits, then
    the scheduler, the workers and Celery all talk TLS and the actions complete."""
    from tangram_celery import AsyncTangramClient, TangramClient
    from tangram_celery.common.config import load_config
    from tangram_celery.deploy import Deployment
    from tangram_celery.transport.broker import resolve_url
    from tests.fixtures.redis import deployment_config
    from tests.fixtures.sandbox import require_sandbox

    broker = {"url": tls_redis.url(), "tls": _tls(tls_redis.certs)}
    path = deployment_config(tmp_path, broker=broker, apis=[CALC])
    cfg = load_config(path)
    require_sandbox(cfg.sandbox.model_dump(mode="json"))
    url = resolve_url(cfg)
    assert url.startswith("rediss://") and "ssl_certfile=" in url and "ssl_cert_reqs=required" in url
    dep = Deployment(cfg, path, with_flower=False, with_http=False)
    try:
        dep.start(progress=False)
        with TangramClient(url) as client:
            calc = client.submit(ApiAction(trajectory_id="t", api="calc", request={"expr": "6*7"}))
            code = client.submit(CodeAction(trajectory_id="t2", code="print(2 + 3)"))
            assert calc.result(timeout=120).output == {"value": 42}
            run = code.result(timeout=120)
            assert run.status is ActionStatus.OK and run.stdout.strip() == "5", run

        async def aio() -> Any:
            async with AsyncTangramClient(url) as c:
                return await c.run(
                    ApiAction(trajectory_id="a", api="calc", request={"expr": "2**10"}), timeout=120
                )

        assert asyncio.run(aio()).output == {"value": 1024}  # the server has no plain port at all
    finally:
        dep.stop()


def test_a_client_without_a_certificate_or_trusting_another_ca_is_refused(tls_redis: Any) -> None:
    """Given the TLS-only Redis, when a client connects with no client certificate, with one from
    another CA, trusting another CA, or over plain redis://, then it is refused; with the right
    files it is answered."""
    c = tls_redis.certs
    ok = tls_redis.url(
        ssl_cert_reqs="required", ssl_ca_certs=c["ca"], ssl_certfile=c["client"], ssl_keyfile=c["client_key"]
    )
    assert redis.Redis.from_url(ok).ping()
    _refused(tls_redis.url(ssl_cert_reqs="required", ssl_ca_certs=c["ca"]))  # no client certificate
    _refused(tls_redis.url(ssl_cert_reqs="required", ssl_ca_certs=c["ca"],
                           ssl_certfile=c["other_client"], ssl_keyfile=c["other_client_key"]))  # fmt: skip
    _refused(tls_redis.url(ssl_cert_reqs="required", ssl_ca_certs=c["other_ca"],
                           ssl_certfile=c["client"], ssl_keyfile=c["client_key"]))  # fmt: skip
    _refused(f"redis://:{tls_redis.password}@127.0.0.1:{tls_redis.port}/0")  # plain text


def test_the_stack_refuses_to_start_with_the_wrong_files(tmp_path: Path, tls_redis: Any) -> None:
    """Given broker.tls trusting another CA, or a missing key file, when the stack or a client
    starts, then it fails with the broker error instead of running without TLS."""
    from tangram_celery import TangramClient
    from tangram_celery.common.config import load_config
    from tangram_celery.common.errors import BrokerError
    from tangram_celery.deploy import Deployment
    from tangram_celery.transport.broker import resolve_url
    from tests.fixtures.redis import deployment_config

    c = tls_redis.certs
    broker = {"url": tls_redis.url(), "tls": _tls(c, ca_file=c["other_ca"])}
    path = deployment_config(tmp_path, broker=broker, nodes={"cpu": []}, apis=[CALC])
    cfg = load_config(path)
    dep = Deployment(cfg, path, with_flower=False, with_http=False)
    try:
        with pytest.raises((BrokerError, redis.ConnectionError)):
            dep.start(progress=False)
    finally:
        dep.stop()
    with pytest.raises((BrokerError, redis.ConnectionError)):
        TangramClient(resolve_url(cfg)).store.ping()
    missing = {"url": tls_redis.url(), "tls": _tls(c, key_file=tmp_path / "nope.key")}
    path = deployment_config(tmp_path, broker=missing, nodes={"cpu": []}, apis=[CALC])
    with pytest.raises(BrokerError, match="ssl_keyfile"):
        resolve_url(load_config(path))


def test_flowers_broker_page_reads_queues_over_rediss(tls_redis: Any) -> None:
    """Given the Celery app of a rediss:// URL, when Flower's broker client is built the way its
    broker page builds it, then it reads queue lengths over TLS with the client certificate."""
    pytest.importorskip("flower")
    from flower.utils.broker import Broker

    from tangram_celery.transport.app import make_app
    from tangram_celery.transport.tls import with_tls

    c = tls_redis.certs
    url = f"{tls_redis.url()}?ssl_ca_certs={c['ca']}&ssl_certfile={c['client']}&ssl_keyfile={c['client_key']}"
    app = make_app(with_tls(url, None))
    redis.Redis.from_url(with_tls(url, None)).lpush("tangram.cpu.n0", "x")
    broker = Broker(
        app.connection().as_uri(include_password=True),
        broker_options=app.conf.broker_transport_options,
        broker_use_ssl=app.conf.broker_use_ssl,
    )
    queues = asyncio.run(broker.queues(["tangram.cpu.n0"]))
    assert queues == [{"name": "tangram.cpu.n0", "messages": 1}]
