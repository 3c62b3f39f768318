"""Per-provider request adaptation, applied in the request-body answer once a provider is chosen.

Clients talk to one OpenAI endpoint with the gateway's model names; each provider may name a
model its own way and want its own API key. For the chosen (provider, model) this module gives:

- the body with `model` rewritten to the pair's `upstream_model` (None when nothing in the
  body changes, so the body goes on untouched; the caller sets `content-length` with a new body);
- the provider's credential header (`authorization: Bearer <key>` or a configured header) read
  once at start-up from an environment variable or a file, never from the configuration file;
- the client's own credential headers (`adaptation.client_credential_headers`) to remove, so a
  client's key never reaches a provider;
- for an unlimited provider (a third party) without `forward_client_identity`, what says who
  the client is or where it connects from, removed as well: the headers of
  `adaptation.private_headers` (cookies, forwarded-for, Envoy's `x-envoy-external-address`,
  ...), the session's trusted identity headers, its session and agent session headers, and the
  body's `user` and `safety_identifier` (CLIENT_IDENTITY_FIELDS): nothing of the client's
  identity leaves for a third party. Own providers get them unchanged;
- the session's affinity inside the provider (config Affinity): an opaque key of the session in
  the header Envoy's route hashes on (a pool) or in the header the provider's own router reads
  (a request without a session loses a copy of that header its client sent), and the cluster (a
  pool's `sessionless_cluster` for a request without a session).

A key never appears in a log line, an error, a metric or a repr: errors name the variable or the
file, never the value.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from extproc.config import Config, Credentials, Provider, ProviderKind

# The body fields that name the client (OpenAI's end-user id and its successor): a third party
# gets neither unless its provider forwards the client's identity.
CLIENT_IDENTITY_FIELDS = ("user", "safety_identifier")


class CredentialError(RuntimeError):
    """A provider's API key cannot be read (variable unset, file missing or empty, bad value)."""


@dataclass(frozen=True, slots=True)
class Adaptation:
    """What to change in a request before it leaves for one provider: the Envoy cluster to route
    to, headers to set (one may hold a key: the repr hides values), headers to remove, and the new
    body or None."""

    cluster: str
    set_headers: dict[str, str] = field(default_factory=dict)
    remove: list[str] = field(default_factory=list)
    body: bytes | None = None

    def __repr__(self) -> str:
        hidden = {name: "<redacted>" for name in self.set_headers}
        size = None if self.body is None else len(self.body)
        return f"Adaptation(cluster={self.cluster!r}, set_headers={hidden}, remove={self.remove}, body_bytes={size})"


class RequestAdapter:
    """Builds each request's `Adaptation`. Reads every provider's key at construction.

    Raises CredentialError when a configured key cannot be read."""

    def __init__(self, config: Config, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        self._client_headers = [h.lower() for h in config.adaptation.client_credential_headers]
        session = config.session
        private = [*config.adaptation.private_headers, *session.trusted_identity_headers, *session.session_headers, *session.agent_session_headers]
        self._private_headers = [h for h in dict.fromkeys(h.lower() for h in private) if h not in self._client_headers]
        self._credentials: dict[str, tuple[str, str]] = {}
        for provider in config.providers:
            if provider.credentials is not None:
                key = read_api_key(provider.name, provider.credentials, environ)
                header = provider.credentials.header
                self._credentials[provider.name] = (header, provider.credentials.header_prefix() + key)
        self._affinity_header = config.server.affinity_header
        self._session_headers = {p.name: p.session_header(self._affinity_header) for p in config.providers}
        self._upstream_models = {
            (p.name, model): entry.upstream_model
            for p in config.providers
            for model, entry in p.models.items()
            if entry.upstream_model and entry.upstream_model != model
        }

    def upstream_model(self, provider: Provider, model: str) -> str | None:
        """The provider's own name for `model` when it differs from the client's, else None."""
        return self._upstream_models.get((provider.name, model))

    def adapt(
        self, provider: Provider, model: str, body: dict | None, session_id: str | None = None, raw: bytes | None = None
    ) -> Adaptation:
        """The changes for sending the request `body` (decoded JSON object; None for a request
        without a body, a lookup by id) for `model` to `provider`, within session `session_id`
        (None: a request without a session; then the header that carries a session's key to
        the provider is removed, so a client cannot pick a replica with its own copy). `raw`:
        the body's bytes, so a rewritten body keeps every integer exact (exact_integers).
        Raises nothing: `body` was decoded from JSON, so it encodes again."""
        headers: dict[str, str] = {}
        session_header = self._session_headers.get(provider.name)
        if session_id is not None and session_header is not None:
            headers[session_header] = affinity_key(session_id)
        cluster = provider.cluster if session_id is not None else provider.sessionless_cluster or provider.cluster
        credential = self._credentials.get(provider.name)
        if credential is not None:
            headers[credential[0]] = credential[1]
        remove = [h for h in self._client_headers if h not in headers]
        private = provider.kind is ProviderKind.UNLIMITED and not provider.forward_client_identity
        if private:
            remove += [h for h in self._private_headers if h not in headers]
        if session_header is not None and session_header not in headers and session_header not in remove:
            if session_header != self._affinity_header:  # that one every request loses with its headers (stream.py)
                remove.append(session_header)  # a request without a session: the client's own copy would pick the replica
        return Adaptation(cluster, headers, remove, None if body is None else self._body(provider, model, body, private, raw))

    def _body(self, provider: Provider, model: str, body: dict, private: bool, raw: bytes | None) -> bytes | None:
        """The body for `provider`: `model` renamed to the pair's upstream name and, when
        `private`, the client's identity fields dropped; None when neither changes anything.
        Every other value is written as the client sent it (exact_integers)."""
        upstream = self._upstream_models.get((provider.name, model))
        dropped = [name for name in CLIENT_IDENTITY_FIELDS if name in body] if private else []
        if upstream is None and not dropped:
            return None
        body, dumps = exact_integers(raw, body)
        if dropped:
            body = {name: value for name, value in body.items() if name not in dropped}
        return dumps({**body, "model": upstream} if upstream is not None else body)


# orjson reads an integer beyond 64 bits (below -2**63, above 2**64 - 1: a `seed` of 2**64) as a
# float and writes it back as one (`1.8446744073709552e+19`), so a rewritten body would change
# the client's value. Such an integer has at least 19 digits: a body without a run of 19 digits
# (found at C speed, about 2 ms per MB) keeps orjson; one with such a run is read again by the
# standard library's decoder, whose integers are exact.
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_SHORTEST_INEXACT_INTEGER = b"0" * 19


def exact_integers(raw: bytes | None, body: dict) -> tuple[dict, Callable[[Any], bytes]]:
    """(the request body, the function that writes a body) such that every integer of `raw`
    (the request's bytes; `body` is orjson's reading of them) is written again exactly: `body`
    and orjson.dumps, or the standard library's reading of `raw` and its compact writer when
    `raw` may hold an integer orjson turned into a float. Raises nothing: `raw` was read by
    orjson, so it is JSON that the standard library reads too (integers of at most about 310
    digits: a longer one is infinite to orjson, which refused it)."""
    if raw is None or _SHORTEST_INEXACT_INTEGER not in raw.translate(_DIGITS_AS_ZERO):
        return body, orjson.dumps
    try:
        exact = json.loads(raw)
    except ValueError:  # not reached: orjson read it
        return body, orjson.dumps
    return exact, _dumps_exact


def _dumps_exact(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def affinity_key(session_id: str) -> str:
    """The key a provider's replicas see for session `session_id`: 32 hex characters of a BLAKE2b
    hash, the same on every proxy. The session id is itself a keyed hash (extproc.openai_api.
    sessions), so the key says nothing of the client; hashing again keeps the Redis key out of
    upstream headers."""
    return hashlib.blake2b(session_id.encode(), digest_size=16, person=b"iris-affinity").hexdigest()


def read_api_key(provider: str, credentials: Credentials, environ: Mapping[str, str]) -> str:
    """The key of `provider` from its variable or file, surrounding whitespace dropped. Raises
    CredentialError naming the variable or file (never the value)."""
    if credentials.api_key_env is not None:
        where = f"environment variable {credentials.api_key_env}"
        value = environ.get(credentials.api_key_env, "")
    else:
        where = f"file {credentials.api_key_file}"
        try:
            value = Path(credentials.api_key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CredentialError(f"provider {provider}: cannot read the API key {where}: {type(exc).__name__}") from None
    value = value.strip()
    if not value:
        raise CredentialError(f"provider {provider}: the API key {where} is not set or empty")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise CredentialError(f"provider {provider}: the API key {where} holds control characters")
    return value
