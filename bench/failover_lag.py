"""Admissions a failover forgets: how many leases answered ADMITTED to the proxy are missing on
the replica promoted after the primary is SIGKILLed under admission load, without and with
`redis.durable_admissions` (WAIT for the replica after every admission).

    python -m bench.failover_lag [--kills 5] [--concurrency 64] [--wait-timeout-ms 50] [--link-delay-ms 0 1]

Each kill: a fresh primary and replica (local processes, in sync; with `--link-delay-ms D` > 0
the replica reaches the primary through a local TCP relay that delays every byte by D ms each
way, a stand-in for a replica in another zone, and whose undelivered bytes are lost at the kill,
as when the primary's host dies: an upper bound for that lag), `--concurrency` workers
admitting new sessions on one managed pair as fast as they can (each admission a new pin and
lease, nothing released), the primary SIGKILLed after a random 0.3-1.0 s, the replica promoted
by `REPLICAOF NO ONE`. Forgotten: lease ids the proxy was told ADMITTED that the promoted
replica's leases key does not hold; each such lease is a request running on the provider that
the promoted Redis does not count (docs/routing-state.md "Durable admissions"). Loopback only; the replica is
on the same machine, so the replication lag is the shortest it can be.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import redis as redis_sync

from bench.admission import MODEL, bench_config
from bench.common import load_average, summarize_ms
from extproc.config import parse_config
from extproc.routing.state import Result, RoutingState, connect
from extproc.storage.keys import Keyspace
from irislab.processes import free_port, spawn, start_redis, wait_for_port
from irislab.redis_topologies import start_replica

LOAD_SECONDS_MAX = 5.0


class DelayLink:
    """A TCP relay on 127.0.0.1 to `target_port`, in a process of its own (`python -m
    bench.failover_lag --relay PORT DELAY_MS`), that delivers every chunk `delay_ms` (ms) after
    it arrived, in order, both ways. `cut()` kills it: whatever it had not delivered is lost."""

    def __init__(self, work: Path, target_port: int, delay_ms: float):
        self.port = free_port()
        argv = [sys.executable, "-m", "bench.failover_lag", "--relay", str(self.port), str(target_port), str(delay_ms)]
        self.process = spawn(f"relay-{self.port}", argv, work)
        wait_for_port(self.port, process=self.process.popen)

    def cut(self) -> None:
        self.process.kill()

    def close(self) -> None:
        self.process.stop()


def relay(port: int, target_port: int, delay_ms: float) -> None:
    """Serve DelayLink's relay until killed."""
    delay = delay_ms / 1000

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if data is None:
                    writer.close()
                    return
                writer.write(data)

        delivery = asyncio.ensure_future(deliver())
        while data := await reader.read(65536):
            queue.put_nowait((loop.time() + delay, data))
        queue.put_nowait((loop.time() + delay, None))
        await delivery

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer), return_exceptions=True)

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(serve())


async def one_kill(work: Path, concurrency: int, wait_replicas: int, wait_timeout_ms: int, delay_ms: float,
                   rng: random.Random) -> dict:
    """One primary killed under load; returns answered, forgotten, the admission rate and the
    admission latencies (ms) before the kill."""
    work.mkdir(parents=True)
    primary = start_redis(work)
    link = DelayLink(work, primary.port, delay_ms) if delay_ms > 0 else None
    replica = start_replica(work / "replica", link.port if link else primary.port)
    try:
        url = f"redis://127.0.0.1:{primary.port}/0"
        config = parse_config(bench_config(url, 1_000_000, wait_replicas, wait_timeout_ms))
        client = connect(url, timeout_seconds=0.5, max_connections=concurrency)
        state = RoutingState(client, config)
        await state.load_scripts()
        answered: list[str] = []
        latencies_ms: list[float] = []
        counter = iter(range(10**9))
        stop_at = time.monotonic() + LOAD_SECONDS_MAX

        async def worker() -> None:
            while time.monotonic() < stop_at:
                asked = time.perf_counter()
                try:
                    admission = await state.try_admit_unpinned_session_request("iris-1", MODEL, f"s{next(counter)}")
                except redis_sync.RedisError:
                    return  # the primary is gone
                if admission.result is Result.ADMITTED:
                    answered.append(admission.lease.id)
                    latencies_ms.append((time.perf_counter() - asked) * 1000)

        async def killer() -> float:
            await asyncio.sleep(rng.uniform(0.3, 1.0))
            if link:
                link.cut()
            primary.kill()
            return time.monotonic()

        started = time.monotonic()
        _, killed_at = await asyncio.gather(asyncio.gather(*(worker() for _ in range(concurrency))), killer())
        await client.aclose()
        promoted = redis_sync.Redis(host="127.0.0.1", port=replica.port)
        promoted.execute_command("REPLICAOF", "NO", "ONE")
        held = {member.decode() for member in promoted.zrange(Keyspace("bench").provider_leases(MODEL, "iris-1"), 0, -1)}
        forgotten = [lease for lease in answered if lease not in held]
        return {"answered": len(answered), "forgotten": len(forgotten), "rate": len(answered) / (killed_at - started),
                "latencies_ms": latencies_ms}
    finally:
        if link:
            link.close()
        replica.stop()
        primary.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--wait-timeout-ms", type=int, default=50)
    parser.add_argument("--link-delay-ms", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--relay", nargs=3, metavar=("PORT", "TARGET_PORT", "DELAY_MS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relay:
        relay(int(args.relay[0]), int(args.relay[1]), float(args.relay[2]))
        return
    rng = random.Random(7)
    work = Path(tempfile.mkdtemp(prefix="iris-failover-lag-"))
    for delay_ms in args.link_delay_ms:
        for wait_replicas in (0, 1):
            runs = [asyncio.run(one_kill(work / f"{delay_ms}-{wait_replicas}-{i}", args.concurrency, wait_replicas,
                                         args.wait_timeout_ms, delay_ms, rng))
                    for i in range(args.kills)]
            mode = f"WAIT 1 {args.wait_timeout_ms}" if wait_replicas else "no WAIT"
            forgotten = [run["forgotten"] for run in runs]
            rate = sum(run["rate"] for run in runs) / len(runs)
            latency = summarize_ms([ms for run in runs for ms in run["latencies_ms"]])
            print(f"link delay {delay_ms:g} ms, {mode:>9}: forgotten per kill {forgotten} (max {max(forgotten)}), "
                  f"{rate:.0f} admissions/s, admission p50 {latency['p50_ms']:.2f} ms p99 {latency['p99_ms']:.2f} ms, "
                  f"load average {load_average():.2f}")


if __name__ == "__main__":
    main()
