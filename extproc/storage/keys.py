"""Every Redis key name the gateway uses, in one place.

Keys of one model share the hash tag ``{<prefix>:<model>}``, so a Redis Cluster keeps everything
one request touches (pins, leases, flags, chain records) in one slot. Keys of the whole fleet (the
epoch, the instance registry) carry the tag ``{<prefix>}``. The Lua scripts receive these names
as KEYS and never build one themselves.
"""

from __future__ import annotations


class Keyspace:
    """Redis key names under `prefix` (the config's `redis.key_prefix`)."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def tag(self, model: str) -> str:
        """The hash tag of `model`'s keys: ``{prefix:model}``."""
        return f"{{{self.prefix}:{model}}}"

    def pin(self, model: str, session_id: str) -> str:
        return f"{self.tag(model)}:pin:{session_id}"

    def session_leases(self, model: str, session_id: str) -> str:
        return f"{self.tag(model)}:session-leases:{session_id}"

    def session_earlier_leases(self, model: str, session_id: str) -> str:
        """The session's leases still running on its earlier pins (after a compare-and-swap)."""
        return f"{self.tag(model)}:session-earlier-leases:{session_id}"

    def provider_pins(self, model: str, provider: str) -> str:
        return f"{self.tag(model)}:pins:{provider}"

    def provider_leases(self, model: str, provider: str) -> str:
        return f"{self.tag(model)}:leases:{provider}"

    def degraded(self, model: str, provider: str, source: str = "manual") -> str:
        """One flag per source (manual, health, passive, load, connect), so clearing one keeps
        the others."""
        return f"{self.tag(model)}:degraded:{provider}:{source}"

    def upstream_failures(self, model: str, provider: str) -> str:
        return f"{self.tag(model)}:failures:{provider}"

    def response_chain(self, model: str, digest: str) -> str:
        """A Responses chain record; `digest` is the keyed hash of (identity, response id)."""
        return f"{self.tag(model)}:response:{digest}"

    def response_chains(self, model: str) -> str:
        """The model's chain records (zset: keyed hash -> expiry, Redis time ms), for their cap."""
        return f"{self.tag(model)}:responses"

    def share_admissions(self, model: str, identity_key: str) -> str:
        """routing.third_party_share: an identity's admissions of `model` in the window (zset:
        lease id -> Redis time, ms); `identity_key` is a keyed hash of the identity."""
        return f"{self.tag(model)}:share-all:{identity_key}"

    def share_unlimited_admissions(self, model: str, identity_key: str) -> str:
        """routing.third_party_share: the same identity's admissions on unlimited providers."""
        return f"{self.tag(model)}:share-unlimited:{identity_key}"

    def epoch(self) -> str:
        """The routing state's epoch (``<uuid>@<Redis time, ms>``): a new one means Redis lost
        the state."""
        return f"{{{self.prefix}}}:epoch"

    def instances(self) -> str:
        """The instance registry (zset: instance id -> heartbeat deadline, ms)."""
        return f"{{{self.prefix}}}:instances"
