"""The live routing config: the snapshot of the routing config a request decides and adapts
with. A reload (extproc.operations.reload) builds a new one and hands it to the stream loop; a
stream reads it once, when its request body arrives, so one request never mixes two configs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis

from extproc.config import Config
from extproc.openai_api.adaptation import RequestAdapter
from extproc.openai_api.chains import ResponseChains
from extproc.openai_api.sessions import SessionKeys
from extproc.protocol import messages as msg
from extproc.routing.degraded import DegradedFlags
from extproc.routing.queue import Wakeups
from extproc.routing.router import Router
from extproc.routing.state import RoutingState
from extproc.storage.pipelined import PipelinedRedis


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """What a request reads of the routing config, built from one Config: the config itself, the
    routing state (limits and timings for the scripts), the router, the request adapter (API keys
    read), the session keys and Responses chains, the set of model names and the `GET /v1/models`
    answer, the passthrough endpoints and the models a stored response may belong to."""

    config: Config
    state: RoutingState
    router: Router
    adapter: RequestAdapter
    sessions: SessionKeys
    chains: ResponseChains
    models: frozenset[str]
    model_list: bytes
    passthrough: dict[str, str]  # passthrough endpoint path -> its feature
    responses_models: tuple[str, ...]  # the models some provider serves with `responses`: where a response id may live


def build_live(
    config: Config, redis: Redis, degraded: DegradedFlags, secret: bytes, wakeups: Wakeups | None = None,
    hot_path: PipelinedRedis | None = None,
) -> LiveConfig:
    """Everything a request needs from `config` (`secret`: the session secret; `wakeups`: the
    process's admission-queue wake-ups, shared by every config; `hot_path`: the process's
    pipelined client for the routing scripts, shared by every config, None to run them over
    `redis`). Raises adaptation.CredentialError when an API key cannot be read."""
    state = RoutingState(redis, config, hot_path=hot_path)
    return LiveConfig(
        config, state, Router(config, state, degraded, wakeups), RequestAdapter(config), SessionKeys(config, secret),
        ResponseChains(redis, config, secret), frozenset(config.models()), msg.model_list_body(config.models(), int(time.time())),
        {e.path: e.feature for e in config.passthrough_endpoints},
        tuple(m for m in config.models() if any(p.supports(m, "responses") for p in config.providers_for(m))),
    )
