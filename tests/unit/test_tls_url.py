"""rediss:// URLs carry broker.tls to every Redis client (issue 37): config checks and URL building."""

from __future__ import annotations

import ssl
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest

from tangram_celery.common.config import parse_config
from tangram_celery.common.config_broker import BrokerTlsConfig
from tangram_celery.common.errors import BrokerError, ConfigError
from tangram_celery.transport.app import make_app
from tangram_celery.transport.tls import ssl_options, with_tls


def _files(tmp_path: Path) -> dict[str, str]:
    out = {}
    for key, name in (("ca_file", "ca.pem"), ("cert_file", "c.pem"), ("key_file", "c.key")):
        (tmp_path / name).write_text("x")
        out[key] = str(tmp_path / name)
    return out


def _query(url: str) -> dict[str, str]:
    return dict(parse_qsl(urlsplit(url).query))


def test_tls_files_go_into_a_rediss_url(tmp_path: Path) -> None:
    """Given broker.tls, when resolved into a rediss:// URL, then the query names each file and
    asks for a verified server; what the URL already says wins; redis:// is left alone."""
    tls = BrokerTlsConfig(**_files(tmp_path))
    q = _query(with_tls("rediss://:pw@h:6380/0", tls))
    assert q == {"ssl_cert_reqs": "required", "ssl_ca_certs": tls.ca_file, "ssl_certfile": tls.cert_file,
                 "ssl_keyfile": tls.key_file}  # fmt: skip
    assert _query(with_tls("rediss://h:1/0?ssl_cert_reqs=optional", None)) == {"ssl_cert_reqs": "optional"}
    assert with_tls("redis://h:1/0", tls) == "redis://h:1/0"
    assert urlsplit(with_tls("rediss://:pw@h:6380/0", tls)).password == "pw"


def test_an_unreadable_tls_file_is_an_error_naming_it(tmp_path: Path) -> None:
    """Given a key file that does not exist, when the URL is built, then BrokerError names it."""
    files = {**_files(tmp_path), "key_file": str(tmp_path / "missing.key")}
    with pytest.raises(BrokerError, match=r"ssl_keyfile.*missing\.key"):
        with_tls("rediss://h:1/0", BrokerTlsConfig(**files))


def test_config_refuses_tls_without_rediss_and_a_lone_certificate(tmp_path: Path) -> None:
    """Given broker.tls with a redis:// URL, or a cert_file without key_file, then the config is refused."""
    files = _files(tmp_path)
    with pytest.raises(ConfigError, match="rediss"):
        parse_config({"broker": {"url": "redis://h:1/0", "tls": files}})
    with pytest.raises(ConfigError, match="cert_file and key_file"):
        parse_config({"broker": {"url": "rediss://h:1/0", "tls": {"cert_file": files["cert_file"]}}})
    cfg = parse_config({"broker": {"url": "rediss://h:1/0", "tls": files}})
    assert cfg.broker.tls is not None and cfg.broker.tls.key_file == files["key_file"]


def test_celery_gets_the_tls_settings_as_a_dict(tmp_path: Path) -> None:
    """Given a rediss:// URL with TLS files, when the Celery app is made, then broker_use_ssl and
    redis_backend_use_ssl hold them with CERT_REQUIRED (Flower's broker page reads that dict)."""
    url = with_tls("rediss://:pw@h:6380/0", BrokerTlsConfig(**_files(tmp_path)))
    opts = ssl_options(url)
    assert opts is not None and opts["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert opts["ssl_certfile"].endswith("c.pem")
    app = make_app(url)
    assert app.conf.broker_use_ssl == opts and app.conf.redis_backend_use_ssl == opts
    assert ssl_options("redis://h:1/0") is None and not make_app("redis://h:1/0").conf.broker_use_ssl
