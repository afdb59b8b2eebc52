"""TLS to a Redis on another host: `rediss://` URLs that carry their CA and client certificate.

Every process of a deployment (scheduler, workers, HTTP server, Flower, clients) is handed the
broker URL and nothing else, so the TLS settings travel in the URL's query, in the parameters
that every Redis client here reads from it: redis-py's sync and asyncio `from_url`, kombu's
transport (Celery's broker) and Celery's Redis result backend:

    rediss://:PASSWORD@redis.internal:6380/0?ssl_cert_reqs=required
        &ssl_ca_certs=/etc/tangram/ca.pem&ssl_certfile=/etc/tangram/client.pem
        &ssl_keyfile=/etc/tangram/client.key

`with_tls` writes `broker.tls` into such a URL (what the URL already says wins), and always
asks for a verified server: kombu alone would fall back to no verification at all for a bare
`rediss://` URL. `ssl_options` reads them back for what wants a dict (Celery's
`broker_use_ssl`, which Flower's broker page needs).
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from tangram_celery.common.config_broker import BrokerTlsConfig
from tangram_celery.common.errors import BrokerError

SCHEME = "rediss"
_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def is_tls(url: str) -> bool:
    return url.startswith(f"{SCHEME}://")


def with_tls(url: str, tls: BrokerTlsConfig | None) -> str:
    """`url` with `tls`'s files (absolute paths) and `ssl_cert_reqs=required` in its query, where
    the URL does not already set them; a non-rediss URL is returned as it is. BrokerError names a
    file that cannot be read (the key is 0600 to the deployment's user: run as that user)."""
    if not is_tls(url):
        return url
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    query.setdefault("ssl_cert_reqs", "required")
    if tls is not None:
        given = {"ssl_ca_certs": tls.ca_file, "ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
        for key, path in given.items():
            if path is not None:
                query.setdefault(key, str(Path(os.path.expanduser(path)).resolve()))
    for key in _FILES:
        if key in query and not os.access(query[key], os.R_OK):
            raise BrokerError(f"broker TLS: {key} file {query[key]!r} is missing or not readable")
    return urlunsplit(parts._replace(query=urlencode(query, quote_via=quote, safe="/")))


def ssl_options(url: str) -> dict[str, Any] | None:
    """The TLS settings in a rediss:// URL's query as Celery's `broker_use_ssl` dict (the
    `ssl.CERT_*` constant for `ssl_cert_reqs`); None for a URL without TLS."""
    if not is_tls(url):
        return None
    query = dict(parse_qsl(urlsplit(url).query))
    reqs = query.get("ssl_cert_reqs", "required")
    out: dict[str, Any] = {"ssl_cert_reqs": _REQS.get(reqs.lower().removeprefix("cert_"), ssl.CERT_REQUIRED)}
    out.update({k: query[k] for k in _FILES if k in query})
    return out
