"""Hot reload of the routing config under load (issue 12): streaming requests run across every
reload; limits are lowered and raised, a provider is removed and added again, bad files are
refused; no request fails, the new limits hold at the providers (the simulators' in-flight
peaks), the metrics count the reloads, and Redis holds no lease afterwards."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
import yaml

from extproc.config.examples import envoy_yaml
from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import MODEL, live_leases, redis_client, wait_for_no_leases, wait_until

pytestmark = pytest.mark.slow

CLIENTS = 6


def limits(slots: int) -> dict:
    return {"max_pinned_sessions": 1000, "max_global_in_flight_request_slots": slots, "max_per_session_in_flight_request_slots": 4}


def routing_config() -> dict:
    return {
        "lease_timeout_seconds": 6,  # renewals every 2 s: long streams renew across the reloads
        "redis": {"key_prefix": "reload"},
        "server": {"expose_routing_headers": True, "reload_poll_seconds": 0.2},  # LocalGateway sets metrics_listen
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {MODEL: {"features": ["chat"], "limits": limits(4)}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2", "models": {MODEL: {"features": ["chat"], "limits": limits(4)}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat"]}}},
        ],
    }


class Load:
    """CLIENTS threads sending streaming chat requests back to back, each a new session, so each
    one goes to the first provider with room (iris-1, iris-2, then the unlimited tensorx)."""

    def __init__(self, url: str):
        self.url = url
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.done = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _client(self, index: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            body = {"model": MODEL, "stream": True, "max_tokens": 40,
                    "messages": [{"role": "user", "content": f"client {index} request {n}"}]}
            with self.lock:
                self.running += 1
            try:
                with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers={"x-user-id": f"c{index}"}, timeout=60) as r:
                    text = r.read().decode()
                    if r.status_code != 200 or not text.rstrip().endswith("data: [DONE]"):
                        self.failures.append(f"{r.status_code} {r.headers.get('x-iris-provider')}: {text[:200]}")
            except httpx.HTTPError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
            finally:
                with self.lock:
                    self.running -= 1
                    self.done += 1

    def wait_for_more(self, count: int) -> None:
        target = self.done + count
        assert wait_until(lambda: self.done >= target, within_seconds=120), (self.done, target)


def stats(gateway: LocalGateway, name: str) -> dict:
    return httpx.get(f"{gateway.provider_url(name)}/stats", timeout=5).json()


def reset(gateway: LocalGateway, name: str) -> None:
    httpx.post(f"{gateway.provider_url(name)}/stats/reset", timeout=5).raise_for_status()


def in_flight_series(instance) -> str:
    """The iris_in_flight_requests lines of the instance's metrics."""
    text = httpx.get(instance.metrics_url, timeout=5).text
    return "\n".join(line for line in text.splitlines() if line.startswith("iris_in_flight_requests{"))


def test_reload_under_load(tmp_path):
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=25, block_tokens=8) for name in ("iris-1", "iris-2", "tensorx")}
    with LocalGateway(config_data=routing_config(), simulations=sims, work_dir=tmp_path) as gateway:
        instance = gateway.running[0]
        path = instance.config_path
        running_config = yaml.safe_load(path.read_text())
        log = instance.extproc.log_tail

        def write(config: dict | str) -> None:
            text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
            temporary = path.with_suffix(".new")
            temporary.write_text(text)
            os.replace(temporary, path)

        def reloaded(n: int) -> None:
            assert wait_until(lambda: f"(reload {n})" in log(1_000_000), within_seconds=30), log(3000)

        def refused(n: int) -> None:
            assert wait_until(lambda: log(1_000_000).count("routing config not reloaded") >= n, within_seconds=30), log(3000)

        def with_limit(config: dict, provider: str, slots: int) -> dict:
            config = yaml.safe_load(yaml.safe_dump(config))
            for entry in config["providers"]:
                if entry["name"] == provider:
                    entry["models"][MODEL]["limits"] = limits(slots)
            return config

        def without(config: dict, provider: str) -> dict:
            return {**config, "providers": [p for p in config["providers"] if p["name"] != provider]}

        def drained_to(name: str, slots: int) -> None:
            """Requests admitted before the reload finish (successfully); then the peak restarts.
            Counted by their leases, which also hold the requests still on their way to `name`,
            and by the provider, whose handler may end just after the lease."""
            state = redis_client(gateway)
            assert wait_until(lambda: live_leases(state, f"*:leases:{name}") <= slots
                              and stats(gateway, name)["in_flight"] <= slots, within_seconds=60)
            reset(gateway, name)

        with Load(instance.url) as load:
            load.wait_for_more(CLIENTS * 2)
            overlapping = []

            # 1. Lower iris-1 to one slot.
            overlapping.append(load.running)
            config = with_limit(running_config, "iris-1", 1)
            write(config)
            reloaded(1)
            drained_to("iris-1", 1)
            load.wait_for_more(CLIENTS * 3)
            assert stats(gateway, "iris-1")["max_in_flight"] <= 1

            # 2. Raise it to three.
            overlapping.append(load.running)
            config = with_limit(config, "iris-1", 3)
            write(config)
            reloaded(2)
            drained_to("iris-1", 3)
            assert wait_until(lambda: stats(gateway, "iris-1")["max_in_flight"] >= 2, within_seconds=60)
            load.wait_for_more(CLIENTS * 3)
            assert stats(gateway, "iris-1")["max_in_flight"] <= 3

            # 3. Remove iris-2: its running requests finish, it gets nothing new.
            overlapping.append(load.running)
            write(without(config, "iris-2"))
            reloaded(3)
            drained_to("iris-2", 0)
            load.wait_for_more(CLIENTS * 3)
            assert stats(gateway, "iris-2")["requests"] == 0 and stats(gateway, "iris-2")["in_flight"] == 0
            assert wait_until(lambda: 'provider="iris-2"' not in in_flight_series(instance), within_seconds=30)  # the fleet gauges follow

            # 4. Add it back: the overflow of iris-1 reaches it again.
            overlapping.append(load.running)
            write(config)
            reloaded(4)
            assert wait_until(lambda: stats(gateway, "iris-2")["requests"] > 0, within_seconds=60)
            assert wait_until(lambda: 'provider="iris-2"' in in_flight_series(instance), within_seconds=30)

            # 5. Bad files keep the running config: invalid, and disagreeing with the Envoy file.
            reset(gateway, "iris-1")
            overlapping.append(load.running)
            broken = with_limit(config, "iris-1", 3)
            broken["providers"][0]["models"][MODEL]["limits"]["max_global_in_flight_request_slots"] = -1
            write(broken)
            refused(1)
            unknown_cluster = yaml.safe_load(yaml.safe_dump(config))
            unknown_cluster["providers"].insert(0, {**unknown_cluster["providers"][0], "name": "iris-3", "cluster": "iris-3"})
            write(unknown_cluster)
            refused(2)
            write("providers: [")
            refused(3)
            load.wait_for_more(CLIENTS * 3)
            assert stats(gateway, "iris-1")["max_in_flight"] <= 3

            # 6. SIGHUP alone reloads: with polling off, a change waits for the signal.
            config = {**with_limit(config, "iris-1", 2), "server": {**config["server"], "reload_poll_seconds": 0}}
            write(config)
            reloaded(5)
            write(with_limit(config, "iris-1", 1))
            os.kill(instance.extproc.pid, signal.SIGHUP)
            reloaded(6)
            drained_to("iris-1", 1)
            load.wait_for_more(CLIENTS * 2)
            assert stats(gateway, "iris-1")["max_in_flight"] <= 1

        assert load.failures == []
        assert all(count > 0 for count in overlapping), overlapping  # every reload had streams running
        assert instance.extproc.alive()
        assert wait_for_no_leases(redis_client(gateway), within_seconds=30) == 0, live_leases(redis_client(gateway))
        text = httpx.get(instance.metrics_url, timeout=5).text
        assert 'iris_config_reloads_total{result="success"} 6.0' in text
        assert 'iris_config_reloads_total{result="failure"} 3.0' in text
        assert "Traceback" not in log(5_000_000)


def test_a_restart_only_change_keeps_the_running_value(tmp_path):
    """Changing the listen address is logged as needing a restart; the server keeps serving."""
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=1) for name in ("iris-1", "iris-2", "tensorx")}
    with LocalGateway(config_data=routing_config(), simulations=sims, work_dir=tmp_path,
                      envoy_source=envoy_yaml()) as gateway:
        instance = gateway.running[0]
        config = yaml.safe_load(instance.config_path.read_text())
        config["server"] = {**config["server"], "listen": "127.0.0.1:1"}
        instance.config_path.write_text(yaml.safe_dump(config))
        log = instance.extproc.log_tail
        assert wait_until(lambda: "(reload 1)" in log(100_000), within_seconds=30)
        assert "server.listen changed" in log(100_000) and "needs a restart" in log(100_000)
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "still here"}]}
        assert httpx.post(f"{instance.url}/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_workers_reload_without_a_false_restart_warning(tmp_path):
    """`serve --workers 2` (issues 20, 22): worker 0 serves both workers' metrics on the file's
    port, worker 1 none, so a reload that changes no restart-only setting must not say
    `server.metrics_listen` needs a restart; a real change of it still does, in worker 0 (the
    only one serving metrics), and the port stays, counting both workers' reloads."""
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=1) for name in ("iris-1", "iris-2", "tensorx")}
    with LocalGateway(config_data=routing_config(), simulations=sims, work_dir=tmp_path, workers=2) as gateway:
        instance = gateway.running[0]
        log = instance.extproc.log_tail  # the supervisor's log: both workers write to it
        config = yaml.safe_load(instance.config_path.read_text())

        def write(new: dict) -> None:
            temporary = instance.config_path.with_suffix(".new")
            temporary.write_text(yaml.safe_dump(new, sort_keys=False))
            os.replace(temporary, instance.config_path)

        def both_reloaded(n: int) -> None:
            assert wait_until(lambda: log(1_000_000).count(f"(reload {n})") == 2, within_seconds=30), log(3000)

        config["providers"][0]["models"][MODEL]["limits"] = limits(2)
        write(config)
        both_reloaded(1)
        assert "needs a restart" not in log(1_000_000), log(3000)

        config["server"] = {**config["server"], "metrics_listen": f"127.0.0.1:{instance.metrics_port + 100}"}
        write(config)
        both_reloaded(2)
        assert log(1_000_000).count("server.metrics_listen changed") == 1, log(3000)
        assert log(1_000_000).count("needs a restart") == 1, log(3000)
        text = httpx.get(instance.metrics_url, timeout=5).text  # the one port, kept
        assert 'iris_config_reloads_total{result="success"} 4.0' in text  # 2 reloads x 2 workers
        assert "Traceback" not in log(1_000_000)


def test_a_malformed_envoy_file_fails_a_reload_and_the_next_one_works(tmp_path):
    """Issue 29 item 9: one malformed value in the Envoy file `serve --envoy` reads (a cluster
    `name: [iris-2]`) fails the reload it is read by: counted, logged in one line, the running
    config stays (iris-1 keeps its 4 slots). Hot reload goes on: once the file is fixed, SIGHUP
    applies the waiting change (iris-1 down to one slot), and a later edit is applied by the
    watcher alone. Streams run across all of it; none fails, Redis holds no lease afterwards."""
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=25, block_tokens=8) for name in ("iris-1", "iris-2", "tensorx")}
    with LocalGateway(config_data=routing_config(), simulations=sims, work_dir=tmp_path) as gateway:
        instance = gateway.running[0]
        log = instance.extproc.log_tail
        good_envoy = instance.envoy_path.read_text()
        envoy = yaml.safe_load(good_envoy)
        (iris2,) = [c for c in envoy["static_resources"]["clusters"] if c["name"] == "iris-2"]
        iris2["name"] = ["iris-2"]
        config = yaml.safe_load(instance.config_path.read_text())

        def write(path, text: str) -> None:
            temporary = path.with_suffix(".new")
            temporary.write_text(text)
            os.replace(temporary, path)

        def with_limit(slots: int) -> str:
            config["providers"][0]["models"][MODEL]["limits"] = limits(slots)
            return yaml.safe_dump(config, sort_keys=False)

        def reloads(result: str) -> float:
            text = httpx.get(instance.metrics_url, timeout=5).text
            line = next((x for x in text.splitlines() if x.startswith(f'iris_config_reloads_total{{result="{result}"}}')), None)
            return 0.0 if line is None else float(line.split()[-1])

        with Load(instance.url) as load:
            load.wait_for_more(CLIENTS)
            overlapping = [load.running]
            write(instance.envoy_path, yaml.safe_dump(envoy, sort_keys=False))
            write(instance.config_path, with_limit(1))
            assert wait_until(lambda: reloads("failure") >= 1, within_seconds=30), log(3000)
            assert "routing config not reloaded" in log(100_000) and "has no name that is a string (name: ['iris-2'])" in log(100_000)
            reset(gateway, "iris-1")
            load.wait_for_more(CLIENTS * 2)
            assert stats(gateway, "iris-1")["max_in_flight"] > 1  # the running config (4 slots) stays

            overlapping.append(load.running)
            write(instance.envoy_path, good_envoy)
            os.kill(instance.extproc.pid, signal.SIGHUP)
            assert wait_until(lambda: "(reload 1)" in log(1_000_000), within_seconds=30), log(3000)
            assert wait_until(lambda: stats(gateway, "iris-1")["in_flight"] <= 1, within_seconds=60)
            reset(gateway, "iris-1")
            load.wait_for_more(CLIENTS * 2)
            assert stats(gateway, "iris-1")["max_in_flight"] <= 1

            overlapping.append(load.running)
            write(instance.config_path, with_limit(3))  # the watcher, not a signal
            assert wait_until(lambda: "(reload 2)" in log(1_000_000), within_seconds=30), log(3000)
            assert wait_until(lambda: stats(gateway, "iris-1")["max_in_flight"] >= 2, within_seconds=60)

        assert load.failures == []
        assert all(count > 0 for count in overlapping), overlapping
        assert (reloads("success"), reloads("failure")) == (2.0, 1.0)
        assert wait_for_no_leases(redis_client(gateway), within_seconds=30) == 0, live_leases(redis_client(gateway))
        assert "Traceback" not in log(5_000_000)
