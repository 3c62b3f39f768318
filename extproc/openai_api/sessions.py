"""Who a client is and which conversation a request belongs to: identity and session key.

The spec's determine_session_id hashes user, model, feature class and the stable prompt prefix.
Real clients say more than their prefix (../shared/notes/session-signals.md), so the session key
comes from the strongest signal present, in the configured order (`session.signals`):

1. `session_header`: an explicit session header (`session.session_headers`, `x-session-id`);
2. `prompt_cache_key`: the body field (OpenAI's own key for prompt-cache routing);
3. `conversation`: a Responses API conversation id;
4. `previous_response_id`: the session of the stored response a Responses turn continues
   (extproc.openai_api.chains keeps response id -> session in Redis);
5. `agent_headers`: the session headers of coding agents (`session.agent_session_headers`:
   Claude Code, Codex CLI, ...);
6. `prefix`: the spec's hash of the stable prompt prefix (extproc.openai_api.request).

The identity is the first present of `session.identity_sources`: a trusted header set by an
authenticating filter, a keyed hash of the client's credential, or the body's
`safety_identifier` / `user`; none gives the anonymous identity "". Every session id is a keyed
hash (HMAC-BLAKE2b with the session secret) of identity, model, feature class, signal and value,
so two identities never share a session and nobody without the secret can compute one.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.config import Config, IdentitySource, SessionSignal
from extproc.openai_api.request import ParsedRequest, keyed_hash, session_id

MAX_SIGNAL_CHARS = 1024  # longer header or field values are hashed as they are, but cut here first


@dataclass(frozen=True, slots=True)
class HeaderSignals:
    """What the request headers say, read in the request-headers phase (before adaptation removes
    the credential): the identity from a trusted header or the credential's keyed hash (None when
    absent), and the first explicit / agent session header value."""

    trusted_identity: str | None = None
    credential_identity: str | None = None
    session_header: str | None = None
    agent_header: str | None = None


@dataclass(frozen=True, slots=True)
class SessionKey:
    """The outcome: `identity` ("" anonymous, else "<source>:<value>"), the `signal` that chose
    the session (None: no session, for example embeddings) and the keyed `session_id`."""

    identity: str
    signal: SessionSignal | None
    session_id: str | None


class SessionKeys:
    """Reads identity and session signals as `config.session` orders them."""

    def __init__(self, config: Config, secret: bytes):
        self.settings = config.session
        self.secret = secret
        self._credential_headers = [h.lower() for h in config.adaptation.client_credential_headers]

    def read_headers(self, headers: Mapping[str, str]) -> HeaderSignals:
        """The signals of the request headers (lowercase name -> value)."""
        trusted = _first(headers, self.settings.trusted_identity_headers)
        credential = _first(headers, self._credential_headers)
        if credential is not None:
            digest = hmac.new(self.secret, b"credential\0" + credential.encode(), hashlib.blake2b).hexdigest()[:32]
            credential = digest
        return HeaderSignals(
            trusted_identity=trusted,
            credential_identity=credential,
            session_header=_first(headers, self.settings.session_headers),
            agent_header=_first(headers, self.settings.agent_session_headers),
        )

    def identity(self, headers: HeaderSignals, request: ParsedRequest | None) -> str:
        """The first present identity source, as "<source>:<value>", or "" (anonymous).
        `request` None: a request without a body (a lookup by id), which has no `body` source."""
        for source in self.settings.identity_sources:
            if source is IdentitySource.TRUSTED_HEADER:
                value = headers.trusted_identity
            elif source is IdentitySource.CREDENTIAL:
                value = headers.credential_identity
            elif request is None:
                value = None
            else:
                value = _body_string(request, "safety_identifier") or _body_string(request, "user")
            if value:
                return f"{source.value}:{value[:MAX_SIGNAL_CHARS]}"
        return ""

    def tenant(self, identity: str) -> str:
        """The admission queue's fairness key of `identity` (docs/queue.md): 16 hex characters of
        its `identity_key`, so Redis never holds the identity itself."""
        return self.identity_key(identity)[:16]

    def session(
        self, headers: HeaderSignals, request: ParsedRequest, identity: str, chained_session: str | None = None
    ) -> SessionKey:
        """The session of `request`: the first signal of `session.signals` that is present.
        `chained_session`: the session id recorded for the request's `previous_response_id`
        (extproc.openai_api.chains), when there is one. Embeddings never form a session."""
        if request.feature == "embeddings":
            return SessionKey(identity, None, None)
        for signal in self.settings.signals:
            if signal is SessionSignal.PREVIOUS_RESPONSE_ID:
                if chained_session:
                    return SessionKey(identity, signal, chained_session)
                continue
            if signal is SessionSignal.PREFIX:
                found = session_id(self.secret, identity, request)
                if found is not None:
                    return SessionKey(identity, signal, found)
                continue
            value = self._signal_value(signal, headers, request)
            if value:
                parts = (identity, request.model, f"{request.feature}|{signal.value}", value[:MAX_SIGNAL_CHARS])
                return SessionKey(identity, signal, keyed_hash(self.secret, *(p.encode() for p in parts)))
        return SessionKey(identity, None, None)

    def identity_key(self, identity: str) -> str:
        """A keyed hash of `identity` (32 hex characters): what Redis keys name an identity by
        (routing.third_party_share), never the identity itself."""
        return keyed_hash(self.secret, b"identity", identity.encode())

    def outranks_previous_response(self, signal: SessionSignal | None) -> bool:
        """Whether `signal` comes before `previous_response_id` in `session.signals` (then a
        chained turn that still sends it finds its session without the chain)."""
        order = self.settings.signals
        if signal is None or signal not in order:
            return False
        if SessionSignal.PREVIOUS_RESPONSE_ID not in order:
            return True
        return order.index(signal) < order.index(SessionSignal.PREVIOUS_RESPONSE_ID)

    @staticmethod
    def _signal_value(signal: SessionSignal, headers: HeaderSignals, request: ParsedRequest) -> str | None:
        if signal is SessionSignal.SESSION_HEADER:
            return headers.session_header
        if signal is SessionSignal.AGENT_HEADERS:
            return headers.agent_header
        if signal is SessionSignal.PROMPT_CACHE_KEY:
            return _body_string(request, "prompt_cache_key")
        return conversation_id(request)


def conversation_id(request: ParsedRequest) -> str | None:
    """The Responses API `conversation`: a string id or an object with an `id`; None otherwise."""
    value = request.body.get("conversation") if request.feature == "responses" else None
    if isinstance(value, dict):
        value = value.get("id")
    return value if isinstance(value, str) and value else None


def previous_response_id(request: ParsedRequest) -> str | None:
    """The Responses API `previous_response_id`, when it is a non-empty string."""
    value = request.body.get("previous_response_id") if request.feature == "responses" else None
    return value if isinstance(value, str) and value else None


def _body_string(request: ParsedRequest, field: str) -> str | None:
    value = request.body.get(field)
    return value if isinstance(value, str) and value else None


def _first(headers: Mapping[str, str], names: list[str]) -> str | None:
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return None
