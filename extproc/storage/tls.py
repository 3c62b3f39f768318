"""The TLS settings of every connection to Redis, in one place, for both clients.

`redis_tls(settings)` reads `config.redis` once: TLS is on when `tls: true` or the standalone
`url` is `rediss://` (`RedisSettings.uses_tls`: either says it; Cluster and Sentinel have no
URL, so `tls: true`), and then
every connection of the topology uses it: a standalone Redis, every node of a Cluster, the
sentinels and the primary they name. The server's certificate is verified against `tls_ca_file`
(PEM; the system's trust store when unset) and must name the host the client connects to (the
`host` of the URL or of `host:port`, or the address a Cluster or the sentinels announce: an IP
address needs an IP subject alternative name). `tls_cert_file` (with `tls_key_file`, or the key
in the same PEM) is the client's certificate, for a Redis with `tls-auth-clients yes`.

The result renders two ways from the same fields: `ssl_context()` for the pipelined hot-path
client (extproc.storage.pipelined) and `redis_py_kwargs()` for redis-py (extproc.storage.client),
which builds its own `ssl.SSLContext` with the same rules (CERT_REQUIRED, hostname checked).

`is_tls_failure(error)` tells a TLS handshake that failed (a certificate not verified, a
plain-text server) from an unreachable Redis: the first is a configuration error, refused at
start (extproc.operations.gateway), never an outage to ride out.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from redis.asyncio.connection import SSLConnection

from extproc.config import ConfigError, RedisSettings


@dataclass(frozen=True)
class RedisTls:
    """TLS toward Redis: `ca_file` (PEM, None for the system's trust store), `cert_file` and
    `key_file` (the client's certificate and key, PEM; None for none). The server's hostname is
    always checked. Build it with `redis_tls`."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        """A client-side SSLContext: the chain verified against `ca_file` (or the system's
        certificates), the server's name checked, the client certificate loaded when set.
        Raises ConfigError naming the setting whose file cannot be read or parsed."""
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ValueError) as exc:
            raise _file_error("redis.tls_ca_file", self.ca_file, exc) from exc
        context.check_hostname = True
        context.verify_mode = ssl.CERT_REQUIRED
        if self.cert_file is not None:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ValueError) as exc:
                raise _file_error("redis.tls_cert_file / tls_key_file", self.cert_file, exc) from exc
        return context

    def redis_py_kwargs(self) -> dict[str, object]:
        """The keyword arguments that make a redis-py client (Redis, RedisCluster, Sentinel and
        its sentinels) speak TLS by these settings: `ssl=True` and its `ssl_*` options."""
        return {
            "ssl": True,
            "ssl_ca_certs": self.ca_file,
            "ssl_certfile": self.cert_file,
            "ssl_keyfile": self.key_file,
            "ssl_cert_reqs": "required",
            "ssl_check_hostname": True,
        }

    def redis_py_pool_kwargs(self) -> dict[str, object]:
        """As `redis_py_kwargs`, for a connection pool built from a URL (a standalone Redis),
        which takes the connection class instead of `ssl=True` (so `redis://` with `tls: true`
        speaks TLS too)."""
        kwargs = self.redis_py_kwargs()
        del kwargs["ssl"]
        return {**kwargs, "connection_class": SSLConnection}


def redis_tls(settings: RedisSettings) -> RedisTls | None:
    """The TLS settings of `settings` (config `redis`), or None when TLS is off (`tls: false`
    and no `rediss://` URL). The files are read once here, so a missing or bad one is refused
    before any connection: raises ConfigError naming the setting."""
    if not settings.uses_tls:
        return None
    tls = RedisTls(settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)
    tls.ssl_context()
    return tls


class RedisTlsError(RuntimeError):
    """Redis refused to be reached over TLS as configured (a certificate not verified against
    `redis.tls_ca_file`, a name that does not match, a server without TLS): a configuration
    error, refused at start. The message names the client and the handshake's error."""


OPENSSL_ERROR_MARK = "[SSL"
"""How Python's ssl module opens the text of an OpenSSL error (`[SSL: CERTIFICATE_VERIFY_FAILED]
certificate verify failed ...`)."""


def is_tls_failure(error: BaseException) -> bool:
    """Whether `error` (what either client raised) is, or was caused by, a failed TLS handshake
    (ssl.SSLError: a certificate not verified, a name that does not match, a server that does
    not speak TLS). The errors that sum up several nodes (redis-py's MasterNotFoundError and
    RedisClusterUnreachableError, the pipelined client's "no sentinel names the primary" and
    "no cluster node answered") carry the handshake's error in their text only."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ssl.SSLError) or OPENSSL_ERROR_MARK in str(error):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _file_error(setting: str, path: str | None, exc: BaseException) -> ConfigError:
    return ConfigError("redis TLS", [f"{setting}: cannot use {path}: {exc}"])
