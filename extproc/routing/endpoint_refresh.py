"""The endpoints of a provider whose `endpoints` are one DNS name, resolved again and again.

A Kubernetes headless Service answers with the address of every ready replica; replicas come and
go, and the name's answer follows. With affinity `pick` the router places requests on the
endpoints it knows (RoutingState.endpoints), so it must follow too: `EndpointRefresh.step`
resolves each such name (extproc.config.endpoints.name_endpoints) and hands a changed answer to
the routing state (RoutingState.set_endpoints), which keeps every endpoint's state keyed by its
`ip:port`: an address added moves no session, one removed moves only its own sessions. Envoy's
STRICT_DNS cluster over the same name follows on its own, on the same period
(`routing.placement.dns_refresh_seconds`).

A name that fails to resolve, or answers no address, keeps the endpoints known: a DNS outage
must not move every session (Envoy's STRICT_DNS keeps its hosts on a failed resolution too). The
failure raises, so the supervised loop (extproc.supervision.run_every, task `endpoint_refresh`)
counts and logs it and retries with a backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from extproc.config.endpoints import SYSTEM_RESOLVER, Resolver, dns_name, name_endpoints
from extproc.routing.state import RoutingState

log = logging.getLogger(__name__)


class EndpointRefresh:
    """Re-resolves the DNS names of the pick providers of the routing state `state()` gives (the
    live one: a reload swaps it) with `resolver` (default the system's). Use `run` under
    run_every with interval 0 (it waits `dns_refresh_seconds` of the live config itself, so a
    reload's new period applies), or call `step` directly."""

    def __init__(self, state: Callable[[], RoutingState], resolver: Resolver = SYSTEM_RESOLVER):
        self._state = state
        self._resolver = resolver

    async def step(self) -> int:
        """Resolve every DNS name once and apply each changed answer. Returns how many providers'
        endpoints changed. Raises EndpointError (after applying the names that resolved) when a
        name does not resolve: its provider keeps the endpoints it had."""
        state = self._state()
        changed, failures = 0, []
        for provider in state.config.providers:
            name = dns_name(provider.endpoints) if provider.picks else None
            if name is None:
                continue
            try:
                endpoints = await asyncio.to_thread(name_endpoints, *name, self._resolver)
            except Exception as exc:  # any failure of the resolver keeps what is known
                failures.append(f"provider {provider.name}: {exc}")
                continue
            before = state.endpoints(provider.name)
            if endpoints != before:
                state.set_endpoints(provider.name, endpoints)
                changed += 1
                log.info("provider %s: %s now resolves to %s (added %s, removed %s)", provider.name, name[0],
                         ", ".join(endpoints), sorted(set(endpoints) - set(before)) or "none",
                         sorted(set(before) - set(endpoints)) or "none")
        if failures:
            raise EndpointResolutionError("; ".join(failures) + " (their endpoints stay as they were)")
        return changed

    async def run(self) -> None:
        """One step, then a wait of the live config's `routing.placement.dns_refresh_seconds`."""
        await self.step()
        await asyncio.sleep(self._state().config.routing.placement.dns_refresh_seconds)

    def needed(self) -> bool:
        """Whether the live config has a pick provider whose endpoints are one DNS name."""
        return any(p.picks and dns_name(p.endpoints) is not None for p in self._state().config.providers)


class EndpointResolutionError(RuntimeError):
    """Some DNS name of a pick provider did not resolve this time (its endpoints are kept)."""
