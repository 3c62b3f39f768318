"""Hostile clients against a running gateway on loopback (issue 15): slow headers, slow bodies,
idle connections, connections over the listener's limit, HTTP/2 stream floods and rapid resets,
while legitimate requests keep being sent. Used by tests/test_flood.py (small) and
`python -m bench.flood` (large).

Everything is bounded: a fixed number of connections and frames, and every wait has a deadline.
The memory of Envoy and of the ext_proc server is sampled from /proc/<pid>/status (VmRSS) during
the whole run.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import hpack
import httpx
from hyperframe.frame import Frame, HeadersFrame, RstStreamFrame, SettingsFrame

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
REFUSED_STREAM = 0x7
CANCEL = 0x8
FRAME_TYPES = {"RST_STREAM": 0x3, "SETTINGS": 0x4, "GOAWAY": 0x7}


@dataclass
class FloodPlan:
    """How much to send. Counts of connections, streams and frames; seconds for durations."""

    idle_connections: int = 40
    slow_header_connections: int = 10
    slow_body_connections: int = 10
    h2_connections: int = 2
    h2_streams_per_connection: int = 100  # HEADERS without END_STREAM: open streams (body to come)
    h2_rapid_resets: int = 200  # HEADERS + RST_STREAM pairs on one more connection
    overflow_connections: int = 0  # idle connections opened at once after the rest, over the limit
    legit_requests: int = 20
    trickle_interval_seconds: float = 0.2  # slow clients send one piece this often
    give_up_seconds: float = 60.0  # a connection Envoy has not closed by then counts as held


@dataclass
class FloodReport:
    """What happened. `closed_by_envoy`: attack connections Envoy ended (timeouts, limits,
    refusals) before `give_up_seconds`; `held`: those still open then."""

    connections_tried: int = 0
    closed_by_envoy: int = 0
    held: int = 0
    streams_tried: int = 0
    streams_refused: int = 0
    goaways: int = 0
    legit_ok: int = 0
    legit_total: int = 0
    legit_statuses: dict[int, int] = field(default_factory=dict)
    peak_rss_kb: dict[str, int] = field(default_factory=dict)
    envoy_stats: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        rate = self.legit_ok / self.legit_total if self.legit_total else 0.0
        peaks = ", ".join(f"{name} {kb / 1024:.0f} MiB" for name, kb in self.peak_rss_kb.items())
        return (
            f"connections tried {self.connections_tried} (closed by Envoy {self.closed_by_envoy}, held {self.held}); "
            f"h2 streams tried {self.streams_tried} (refused {self.streams_refused}, GOAWAYs {self.goaways}); "
            f"legitimate requests {self.legit_ok}/{self.legit_total} ok ({rate:.1%}); peak RSS {peaks}"
        )


def rss_kb(pid: int) -> int:
    """Resident set size of process `pid` in KiB (VmRSS of /proc/<pid>/status), 0 if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class MemorySampler:
    """Samples the RSS of named pids from a thread every `interval_seconds`; `peaks` in KiB."""

    def __init__(self, pids: dict[str, int], interval_seconds: float = 0.05):
        self.pids = pids
        self.interval = interval_seconds
        self.peaks = {name: rss_kb(pid) for name, pid in pids.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for name, pid in self.pids.items():
                self.peaks[name] = max(self.peaks[name], rss_kb(pid))


async def _closed_by_peer(reader: asyncio.StreamReader, deadline: float) -> bool:
    """Read (and drop) until the peer closes (True) or `deadline` (loop time) passes (False)."""
    try:
        async with asyncio.timeout_at(deadline):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except (ConnectionError, OSError):
        pass
    return True


async def _connect(port: int):
    return await asyncio.open_connection("127.0.0.1", port)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


async def idle_connection(port: int, plan: FloodPlan) -> bool:
    """Connect and send nothing: True when Envoy closes it (idle timeout or connection limit)."""
    reader, writer = await _connect(port)
    try:
        return await _closed_by_peer(reader, asyncio.get_running_loop().time() + plan.give_up_seconds)
    finally:
        await _close(writer)


async def _trickle(port: int, head: bytes, pieces: list[bytes], plan: FloodPlan) -> bool:
    """Send `head`, then one piece per trickle interval, until Envoy closes the connection."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + plan.give_up_seconds
    reader, writer = await _connect(port)
    try:
        writer.write(head)
        closed = asyncio.create_task(_closed_by_peer(reader, deadline))
        for piece in pieces:
            done, _ = await asyncio.wait({closed}, timeout=plan.trickle_interval_seconds)
            if done:
                break
            try:
                writer.write(piece)
                await writer.drain()
            except (ConnectionError, OSError):
                break
        return await closed
    finally:
        await _close(writer)


async def slow_headers(port: int, plan: FloodPlan) -> bool:
    """Request headers one short line per interval, never finished (slowloris)."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
    pieces = [f"x-slow-{i}: {i}\r\n".encode() for i in range(10_000)]
    return await _trickle(port, head, pieces, plan)


async def slow_body(port: int, plan: FloodPlan) -> bool:
    """Complete headers announcing a 1 MB body, then a few bytes per interval."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\ncontent-type: application/json\r\n"
            b"x-user-id: slow\r\ncontent-length: 1000000\r\n\r\n{\"model\": \"")
    return await _trickle(port, head, [b"aaaa"] * 250_000, plan)


def _h2_request_headers(encoder: hpack.Encoder, stream_id: int, end_stream: bool) -> bytes:
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", "gateway"),
               (":path", "/v1/chat/completions"), ("content-type", "application/json"),
               ("content-length", "100000"), ("x-user-id", "h2flood")]
    flags = ["END_HEADERS"] + (["END_STREAM"] if end_stream else [])
    return HeadersFrame(stream_id, data=encoder.encode(headers), flags=flags).serialize()


class _H2Counts:
    def __init__(self):
        self.refused = 0
        self.resets = 0
        self.goaway = False


async def _read_h2(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counts: _H2Counts, deadline: float) -> bool:
    """Parse the server's frames (ACK its SETTINGS, count RST_STREAM and GOAWAY) until it
    closes the connection (True) or `deadline` passes (False)."""
    try:
        async with asyncio.timeout_at(deadline):
            while True:
                header = await reader.readexactly(9)
                _, length = Frame.parse_frame_header(memoryview(header))
                _count_frame(header, await reader.readexactly(length), writer, counts)
    except TimeoutError:
        return False
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        return True


def _count_frame(header: bytes, body: bytes, writer: asyncio.StreamWriter, counts: _H2Counts) -> None:
    kind = header[3]
    if kind == FRAME_TYPES["SETTINGS"] and not header[4] & 0x1:
        writer.write(SettingsFrame(0, flags=["ACK"]).serialize())
    elif kind == FRAME_TYPES["RST_STREAM"]:
        counts.resets += 1
        if int.from_bytes(body[:4], "big") == REFUSED_STREAM:
            counts.refused += 1
    elif kind == FRAME_TYPES["GOAWAY"]:
        counts.goaway = True


async def h2_stream_flood(port: int, streams: int, plan: FloodPlan, rapid_reset: bool) -> tuple[bool, _H2Counts]:
    """One HTTP/2 (prior knowledge) connection opening `streams` request streams without ending
    them (bodies never come), or with `rapid_reset` cancelling each right after its HEADERS.
    Returns (closed by Envoy, counts)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + plan.give_up_seconds
    reader, writer = await _connect(port)
    counts = _H2Counts()
    encoder = hpack.Encoder()
    try:
        writer.write(H2_PREFACE + SettingsFrame(0, settings={SettingsFrame.ENABLE_PUSH: 0}).serialize())
        closed = asyncio.create_task(_read_h2(reader, writer, counts, deadline))
        for i in range(streams):
            stream_id = 1 + 2 * i
            frame = _h2_request_headers(encoder, stream_id, end_stream=False)
            if rapid_reset:
                frame += RstStreamFrame(stream_id, error_code=CANCEL).serialize()
            try:
                writer.write(frame)
                if i % 16 == 15:
                    await writer.drain()
            except (ConnectionError, OSError):
                break
            if closed.done():
                break
        return await closed, counts
    finally:
        await _close(writer)


async def legitimate_requests(url: str, count: int, model: str, report: FloodReport) -> None:
    """`count` small chat requests one after the other; each 200 counts as a success."""
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(count):
            body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": f"legit {i}"}]}
            try:
                response = await client.post(f"{url}/v1/chat/completions", json=body, headers={"x-user-id": f"legit-{i}"})
                status = response.status_code
            except httpx.HTTPError:
                status = 0
            report.legit_total += 1
            report.legit_statuses[status] = report.legit_statuses.get(status, 0) + 1
            report.legit_ok += status == 200


def envoy_stats(admin_port: int) -> dict[str, int]:
    """Envoy's counters that show the limits at work (admin /stats, plain text)."""
    wanted = ("downstream_cx_overflow", "downstream_rq_timeout", "downstream_rq_header_timeout",
              "downstream_cx_idle_timeout", "downstream_cx_destroy_remote", "rx_reset", "tx_reset",
              "downstream_cx_total", "downstream_rq_too_large", "inbound_empty_frames_flood",
              "downstream_rq_rx_reset")
    text = httpx.get(f"http://127.0.0.1:{admin_port}/stats", timeout=10).text
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if any(name.endswith(w) for w in wanted) and value.strip().isdigit():
            out[name] = int(value)
    return out


async def run_flood(listener_port: int, url: str, model: str, plan: FloodPlan, report: FloodReport) -> None:
    """Run every attack of `plan` at once with the legitimate requests, then the overflow burst."""
    attacks = [idle_connection(listener_port, plan) for _ in range(plan.idle_connections)]
    attacks += [slow_headers(listener_port, plan) for _ in range(plan.slow_header_connections)]
    attacks += [slow_body(listener_port, plan) for _ in range(plan.slow_body_connections)]
    h2 = [h2_stream_flood(listener_port, plan.h2_streams_per_connection, plan, False) for _ in range(plan.h2_connections)]
    if plan.h2_rapid_resets:
        h2.append(h2_stream_flood(listener_port, plan.h2_rapid_resets, plan, True))
    report.connections_tried += len(attacks) + len(h2)
    report.streams_tried += plan.h2_connections * plan.h2_streams_per_connection + plan.h2_rapid_resets
    legit = asyncio.create_task(legitimate_requests(url, plan.legit_requests, model, report))
    results = await asyncio.gather(*attacks, *h2)
    plain, h2_results = results[: len(attacks)], results[len(attacks):]
    for closed in plain:
        report.closed_by_envoy += closed
        report.held += not closed
    for closed, counts in h2_results:
        report.closed_by_envoy += closed
        report.held += not closed
        report.streams_refused += counts.refused
        report.goaways += counts.goaway
    await legit
    if plan.overflow_connections:
        report.connections_tried += plan.overflow_connections
        burst = await asyncio.gather(*(idle_connection(listener_port, plan) for _ in range(plan.overflow_connections)))
        report.closed_by_envoy += sum(burst)
        report.held += len(burst) - sum(burst)


def flood(listener_port: int, admin_port: int, url: str, model: str, pids: dict[str, int], plan: FloodPlan) -> FloodReport:
    """Run `plan` against the gateway at `url` (its Envoy listener and admin ports), sampling the
    RSS of `pids` ({name: pid}) throughout. Blocks until every attack connection has ended."""
    report = FloodReport()
    with MemorySampler(pids) as sampler:
        started = time.monotonic()
        asyncio.run(run_flood(listener_port, url, model, plan, report))
        report.envoy_stats = envoy_stats(admin_port)
        report.envoy_stats["flood_seconds"] = round(time.monotonic() - started)
    report.peak_rss_kb = dict(sampler.peaks)
    return report


def envoy_yaml_with_limits(
    dest: Path,
    *,
    connection_limit: int | None = None,
    request_headers_timeout: str | None = None,
    request_timeout: str | None = None,
    idle_timeout: str | None = None,
    source: Path | None = None,
) -> Path:
    """A copy of envoy/envoy.yaml (or `source`) at `dest` with the listener's connection limit
    and the HTTP connection manager's timeouts (Envoy durations such as "2s") replaced, so a
    test meets them within seconds. Everything else, ports included, is unchanged."""
    from irislab import envoy_config

    bootstrap = envoy_config.load_envoy_yaml(source or envoy_config.DEFAULT_ENVOY_YAML)
    if connection_limit is not None:
        layer = bootstrap["layered_runtime"]["layers"][0]["static_layer"]
        layer["envoy.resource_limits.listener.openai.connection_limit"] = connection_limit
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    if request_headers_timeout is not None:
        hcm["request_headers_timeout"] = request_headers_timeout
    if request_timeout is not None:
        hcm["request_timeout"] = request_timeout
    if idle_timeout is not None:
        hcm["common_http_protocol_options"]["idle_timeout"] = idle_timeout
    return envoy_config.write(bootstrap, dest)
