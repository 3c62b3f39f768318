"""The request's side of endpoint placement for providers with affinity `pick`
(docs/routing-state.md "Endpoint placement"): the prompt's chained block hashes.

The admission scripts (lua/lib.lua `rank_endpoints`) score each endpoint of a pick pair by how
many of the prompt's leading blocks its prefix index holds. The blocks are computed here, in
Python, from the stable prompt prefix (extproc.openai_api.request: for chat the system/developer
messages and the first user message; for completions the prompt's first characters): the prefix
cut into blocks of `block_chars` bytes (the last one may be shorter), at most `max_blocks`, each
block's hash a BLAKE2b of the previous hash and the block, so that one hash stands for the whole
prefix up to its block (two prompts share block i's hash only if they share blocks 1..i).

The blocks of the request being decided ride to the scripts in a context variable set around the
decision (`deciding_with`), so the routing core (router, lease table) passes nothing new; the
routing state reads them (`current_blocks`) for the admitting scripts of a model with a pick pair.
So does the storing endpoint of a Responses turn that continues a stored response
(`previous_response_id`): the replica that holds it, which the scripts place the turn on first
(`current_chained`, lua/lib.lua `rank_endpoints`).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Iterator

HASH_BYTES = 8  # 64 bits per block hash, 16 hex characters: collisions negligible per endpoint index

_BLOCKS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("iris_prompt_blocks", default=())
_CHAINED: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("iris_chained_endpoint", default=None)


def prompt_blocks(prefix: bytes | None, block_chars: int, max_blocks: int) -> tuple[str, ...]:
    """The chained hashes (16 hex characters each) of `prefix`'s leading blocks of `block_chars`
    bytes, at most `max_blocks` of them; () for no prefix."""
    if not prefix:
        return ()
    hashes = []
    previous = b""
    for start in range(0, min(len(prefix), block_chars * max_blocks), block_chars):
        previous = hashlib.blake2b(previous + prefix[start : start + block_chars], digest_size=HASH_BYTES).digest()
        hashes.append(previous.hex())
    return tuple(hashes)


@contextlib.contextmanager
def deciding_with(blocks: tuple[str, ...], chained: tuple[str, str] | None = None) -> Iterator[None]:
    """Within the block (and the tasks it starts, which copy its context), the routing state's
    admissions place with `blocks`, and, with `chained` (provider name, endpoint `ip:port`: where
    the previous response of a Responses turn is stored), on that endpoint of that provider first."""
    token, chained_token = _BLOCKS.set(blocks), _CHAINED.set(chained)
    try:
        yield
    finally:
        _CHAINED.reset(chained_token)
        _BLOCKS.reset(token)


def current_blocks() -> tuple[str, ...]:
    """The prompt blocks of the decision running in this context (`deciding_with`), else ()."""
    return _BLOCKS.get()


def current_chained() -> tuple[str, str] | None:
    """The (provider, endpoint) storing the previous response of the decision running in this
    context (`deciding_with`), else None."""
    return _CHAINED.get()
