"""The session secret: the key of every session id's keyed hash (extproc.openai_api.sessions), read
from the environment variable `session.secret_env` names (IRIS_SESSION_SECRET by default) and
refused when it is missing or weak, at start (`serve`) and by `check`.

Weak means, without ever printing the value: a shipped placeholder (deploy/kubernetes/secret.yaml's
`replace-with-32-random-bytes`, the docs' former `change-me`), fewer than 32 bytes (256 bits, what
that placeholder asks for: beyond brute force of the HMAC-BLAKE2b key), or a value that repeats itself
(`passwordpassword...`, `abab...`, `0123456789012...`): deflate's string matching shrinks it below
70 % of what Huffman coding alone gives, where random text stays above 80 % (measured: 100,000
values each of `secrets.token_hex(16)`, `token_hex(32)` and `token_urlsafe(24)`, lowest 82 %).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping

from extproc.config import Config

MIN_SECRET_BYTES = 32
# Placeholders shipped in this repository's examples: a deployment that kept one has no secret.
PLACEHOLDERS = ("replace-with-32-random-bytes", "change-me", "changeme")
# Deflate with string matching against Huffman coding alone: below this, the value repeats itself.
MIN_REPEAT_RATIO = 0.7
HOW_TO_MAKE_ONE = "make one with `openssl rand -hex 32` or `python -c 'import secrets; print(secrets.token_hex(32))'`"


class SessionSecretError(RuntimeError):
    """The session secret's environment variable is unset, empty, or holds a weak value; the
    message names the variable and the setting, never the value."""


def session_secret(config: Config, environ: Mapping[str, str] = os.environ) -> bytes:
    """The session secret, as bytes, from the variable `config.session.secret_env` names in
    `environ`. Raises SessionSecretError when it is unset or empty (every proxy instance must share
    one secret, so none is invented) or weak (`weakness`)."""
    name = config.session.secret_env
    value = environ.get(name)
    if not value:
        raise SessionSecretError(
            f"set {name} (session.secret_env) to the session secret shared by every proxy instance: at least "
            f"{MIN_SECRET_BYTES} random bytes; {HOW_TO_MAKE_ONE}"
        )
    problem = weakness(value)
    if problem is not None:
        raise SessionSecretError(f"{name} (session.secret_env) {problem}: use at least {MIN_SECRET_BYTES} random bytes; {HOW_TO_MAKE_ONE}")
    return value.encode()


def weakness(value: str) -> str | None:
    """Why `value` is too weak to key session ids (a phrase that never quotes it), or None."""
    lowered = value.strip().lower()
    if lowered in PLACEHOLDERS or lowered.startswith("replace-with-"):
        return "is a placeholder from this project's examples"
    raw = value.encode()
    if len(raw) < MIN_SECRET_BYTES:
        return f"is {len(raw)} bytes long"
    if _deflated(raw, zlib.Z_DEFAULT_STRATEGY) < MIN_REPEAT_RATIO * _deflated(raw, zlib.Z_HUFFMAN_ONLY):
        return "repeats itself (a pattern, not random bytes)"
    return None


def _deflated(raw: bytes, strategy: int) -> int:
    """The size in bytes of `raw` under raw deflate (level 9) with `strategy`."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15, 9, strategy)
    return len(compressor.compress(raw) + compressor.flush())
