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

    # The admission queue (docs/queue.md): same hash tag as the pair's leases, so one script
    # touches both.

    def queue(self, model: str, provider: str) -> str:
        """The pair's waiting tickets (zset: ticket id -> score: class, round, arrival)."""
        return f"{self.tag(model)}:queue:{provider}"

    def reserved_queue(self, model: str, provider: str) -> str:
        """The pair's waiting tickets that may use the slots reserved for pinned sessions."""
        return f"{self.tag(model)}:queue-reserved:{provider}"

    def tickets(self, model: str) -> str:
        """The model's tickets (zset: ticket id -> ticket lease deadline, Redis time ms)."""
        return f"{self.tag(model)}:tickets"

    def queue_state(self, model: str) -> str:
        """The model's queue bookkeeping (hash: tickets' class and round, rounds served, tenants'
        live tickets, the arrival counter)."""
        return f"{self.tag(model)}:queue-state"

    def queue_finish(self, model: str) -> str:
        """Fair queueing's finish tags (zset: "<class>|<tenant>" -> class span + round)."""
        return f"{self.tag(model)}:queue-finish"

    def queue_wake(self, model: str) -> str:
        """The pub/sub channel on which scripts name the tickets that may take a freed slot."""
        return f"{self.tag(model)}:queue-wake"
    # Affinity `pick` (docs/routing-state.md "Endpoint placement"): per endpoint of a pair,
    # `endpoint` its `ip:port` (extproc.config.endpoints).

    def endpoint_leases(self, model: str, provider: str, endpoint: str) -> str:
        """The pair's leases running on one endpoint (zset: lease id -> lease deadline, Redis
        time ms), a subset of the pair's leases: the endpoint's exact in-flight count."""
        return f"{self.tag(model)}:endpoint-leases:{provider}:{endpoint}"

    def endpoint_prefixes(self, model: str, provider: str, endpoint: str) -> str:
        """The approximate prefix index of one endpoint (zset: chained block hash -> when the
        endpoint last served it, Redis time ms), trimmed to the latest ones."""
        return f"{self.tag(model)}:endpoint-prefixes:{provider}:{endpoint}"

    def endpoint_health(self, model: str, provider: str) -> str:
        """The health flags of a pick pair's endpoints (hash: "<ip:port> <source>" -> "<until,
        Redis time ms> <reason>"; extproc.routing.endpoint_health), read by the placing scripts."""
        return f"{self.tag(model)}:endpoint-health:{provider}"

    def endpoint_failures(self, model: str, provider: str, endpoint: str) -> str:
        """One endpoint's recent upstream failures (zset: failure id -> Redis time, ms): the
        passive check per endpoint (lua/endpoint_failure.lua)."""
        return f"{self.tag(model)}:endpoint-failures:{provider}:{endpoint}"

    def share_admissions(self, model: str, identity_key: str) -> str:
        """routing.third_party_share: an identity's admissions of `model` in the window (zset:
        lease id -> Redis time, ms); `identity_key` is a keyed hash of the identity."""
        return f"{self.tag(model)}:share-all:{identity_key}"

    def share_unlimited_admissions(self, model: str, identity_key: str) -> str:
        """routing.third_party_share: the same identity's admissions on unlimited providers."""
        return f"{self.tag(model)}:share-unlimited:{identity_key}"

    def epoch(self) -> str:
        """The routing state's epoch (``<uuid>@<Redis time, ms>``, ``:lost`` appended when written
        by an instance that knew an earlier state): a new one means Redis lost the state."""
        return f"{{{self.prefix}}}:epoch"

    def instances(self) -> str:
        """The instance registry (zset: instance id -> heartbeat deadline, ms)."""
        return f"{{{self.prefix}}}:instances"

    def instance(self, instance_id: str) -> str:
        """What a live instance runs (its routing config without Redis addresses), renewed with
        its heartbeat, so `status` can show the fleet without a routing file."""
        return f"{{{self.prefix}}}:instance:{instance_id}"
