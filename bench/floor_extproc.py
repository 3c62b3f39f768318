"""The floor of the ext_proc protocol in Python: an ext_proc server that routes every request to
one cluster and does nothing else (no parsing, no Redis, no lease, no metric).

It speaks the same protocol as the gateway's server (extproc.protocol.stream), on the same stack (grpcio's
aio server, uvloop, the upb-backed types of xds-protos, extproc.protocol.messages' builders), behind
the same envoy/envoy.yaml: it answers the request headers (removing the routing header), the
buffered request body (setting the routing header with clear_route_cache, as the gateway routes)
and the response headers, and serves grpc.health.v1 for Envoy's health check. What a request
costs through it is what the gateway cannot go below while it keeps these three message
exchanges: `bench.overhead` measures it as the `floor` path.

    python -m bench.floor_extproc --port 50051 --cluster iris-1
"""

from __future__ import annotations

import argparse

import grpc
import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.operations.gateway import HEALTH_SERVICES
from extproc.protocol import messages as msg

ROUTING_HEADER = "x-iris-cluster"


class FloorProcessor(ext_proc_grpc.ExternalProcessorServicer):
    """Answers every phase at once; the request body's answer routes to `cluster`."""

    def __init__(self, cluster: str, routing_header: str = ROUTING_HEADER):
        self.headers_answer = msg.continue_request_headers(remove=[routing_header])
        self.body_answer = msg.route_to_cluster(routing_header, cluster)
        self.response_headers_answer = msg.continue_response_headers()
        self.trailers_answer = msg.continue_response_trailers()

    async def Process(self, request_iterator, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 (gRPC name)
        answers = {
            "request_headers": self.headers_answer, "request_body": self.body_answer,
            "response_headers": self.response_headers_answer, "response_trailers": self.trailers_answer,
        }
        while (request := await context.read()) is not grpc.aio.EOF:
            answer = answers.get(request.WhichOneof("request"))
            if answer is not None:
                await context.write(answer)


async def serve(port: int, cluster: str) -> None:
    """Serve on 127.0.0.1:`port` until cancelled."""
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(FloorProcessor(cluster), server)
    health = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    for service in HEALTH_SERVICES:
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor_extproc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cluster", required=True, help="the Envoy cluster every request goes to")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.port, args.cluster))


if __name__ == "__main__":
    main()
