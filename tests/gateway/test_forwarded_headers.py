"""Issue 24: Envoy 1.40 forwards to the ext_proc server only the headers the router reads
(`forward_rules`, rendered from the config by `iris-extproc envoy-config`), in both directions,
pseudo-headers included, and nothing else. A real Envoy runs the rendered bootstrap in front of
a recording ext_proc server (it routes every request to one cluster, as the gateway does) and a
plain HTTP upstream; the client sends headers the router reads and headers it does not."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.config import envoy_check, envoy_render, parse_config
from extproc.config.examples import example_config
from extproc.operations.gateway import HEALTH_SERVICES
from extproc.protocol import messages as msg
from irislab import envoy_config
from irislab.processes import envoy_binary, free_port, spawn, wait_for_port


class Recorder(ext_proc_grpc.ExternalProcessorServicer):
    """Records each phase's headers (name -> value); routes every request to `cluster`."""

    def __init__(self, routing_header: str, cluster: str):
        self.seen: dict[str, list[dict[str, str]]] = {"request_headers": [], "response_headers": []}
        self.answers = {
            "request_headers": msg.continue_request_headers([routing_header]),
            "request_body": msg.route_to_cluster(routing_header, cluster),
            "response_headers": msg.continue_response_headers(),
            "response_trailers": msg.continue_response_trailers(),
        }

    async def Process(self, request_iterator, context):  # noqa: N802 (gRPC name)
        while (request := await context.read()) is not grpc.aio.EOF:
            phase = request.WhichOneof("request")
            if phase in self.seen:
                self.seen[phase].append(msg.header_map(getattr(request, phase)))
            if phase in self.answers:
                await context.write(self.answers[phase])


class Upstream(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server name)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = b'{"id": "x", "object": "chat.completion", "choices": []}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.send_header("x-upstream-extra", "not read")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def config_data() -> dict:
    data = yaml.safe_load(example_config().read_text())
    data["session"].update(trusted_identity_headers=["x-auth-subject"], session_headers=["x-conversation-key"])
    return data


async def test_envoy_forwards_only_the_headers_the_router_reads(tmp_path):
    config = parse_config(config_data())
    cluster = config.providers[0].cluster
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    recorder = Recorder(config.server.routing_header, cluster)
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(recorder, server)
    health = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    for service in HEALTH_SERVICES:
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    await server.start()

    bootstrap = envoy_render.render(config, envoy_config.load_envoy_yaml())
    # The lab's stand-in for the authenticating filter that sets the trusted identity header.
    envoy_config.with_stand_in_authentication(bootstrap, ["x-auth-subject"])
    providers = {c["name"]: upstream.server_address[1] for c in bootstrap["static_resources"]["clusters"] if c["name"] != "extproc"}
    listener = free_port()
    envoy_config.render_onto(bootstrap, listener, free_port(), {"extproc": grpc_port, **providers})
    path = envoy_config.write(bootstrap, tmp_path / "envoy.yaml")
    envoy = spawn("envoy", [envoy_binary(), "-c", str(path), "-l", "warning", "--concurrency", "1", "--disable-hot-restart"], tmp_path)
    try:
        await asyncio.to_thread(wait_for_port, listener, 20.0, envoy.popen)
        sent = {
            "x-auth-subject": "alice", "x-conversation-key": "c-1", "authorization": "Bearer k",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "x-not-read": "1", "x-iris-user": "the example's identity header, not this config's", "user-agent": "trims-test",
        }
        body = {"model": next(iter(config.providers[0].models)), "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(timeout=10) as client:
            for _ in range(200):  # until Envoy's first health check of the ext_proc server passed
                response = await client.post(f"http://127.0.0.1:{listener}/v1/chat/completions", json=body, headers=sent)
                if response.status_code == 200:
                    break
                await asyncio.sleep(0.1)
        assert response.status_code == 200, response.text
        assert response.headers["x-upstream-extra"] == "not read"  # the client still gets every header
    finally:
        envoy.stop()
        await server.stop(None)
        upstream.shutdown()

    read = set(envoy_check.read_headers(config))
    request_headers = recorder.seen["request_headers"][-1]
    assert request_headers[":path"] == "/v1/chat/completions" and request_headers[":method"] == "POST"
    assert request_headers["x-auth-subject"] == "alice"  # the configured identity header is forwarded
    assert request_headers["x-conversation-key"] == "c-1" and request_headers["authorization"] == "Bearer k"
    assert request_headers["traceparent"].startswith("00-") and int(request_headers["content-length"]) > 0
    assert set(request_headers) <= read, set(request_headers) - read
    assert not {"x-not-read", "x-iris-user", "user-agent", ":authority", ":scheme", "x-request-id"} & set(request_headers)
    response_headers = recorder.seen["response_headers"][-1]
    assert response_headers[":status"] == "200" and response_headers["content-type"] == "application/json"
    assert set(response_headers) <= read and "x-upstream-extra" not in response_headers
