"""The spans of routed requests (extproc.protocol.tracing), exported to a real OTLP/gRPC collector
in this process (irislab.otlp_collector): the attributes a provider's endpoint and kind decide,
what reaches a third party, and sampling."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from importlib.metadata import version

import pytest
import yaml

from extproc.config import parse_config
from extproc.protocol.tracing import RequestTracer, carrier, start_tracing
from irislab.otlp_collector import OtlpCollector
from tests.support.configs import ROOT, small_config_data

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def collector():
    with OtlpCollector() as running:
        yield running


def tracer_for(collector: OtlpCollector, **tracing) -> tuple[RequestTracer, dict]:
    providers = small_config_data()["providers"]
    providers[0]["endpoints"] = ["https://iris-1.example:8443"]
    providers[1]["endpoints"] = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    providers.append({"name": "partner", "kind": "unlimited", "cluster": "partner", "forward_client_identity": True,
                      "models": {"m": {"features": ["chat"]}}})
    config = parse_config(small_config_data(providers=providers, tracing={"otlp_endpoint": collector.endpoint, **tracing}))
    return start_tracing(config.tracing), {p.name: p for p in config.providers}


def test_off_without_an_endpoint():
    assert start_tracing(parse_config(small_config_data()).tracing) is None


def test_only_the_trace_context_headers_are_carried():
    assert carrier({"traceparent": CLIENT, "tracestate": "a=1", "authorization": "x"}) == {"traceparent": CLIENT, "tracestate": "a=1"}
    assert carrier({"authorization": "x"}) is None


def test_who_gets_the_trace_context_and_what_the_endpoint_tells(collector):
    tracer, providers = tracer_for(collector)
    sent = {}
    for name in ("iris-1", "iris-2", "tensorx", "partner"):
        span = tracer.start(carrier({"traceparent": CLIENT}), "completions", "m")
        sent[name] = tracer.routed(span, providers[name], "unpinned", None, 0.2)
        tracer.finish(span, 200 if name != "iris-2" else 503)
    tracer.shutdown()
    spans = {s.attributes["iris.routing.provider"]: s for s in collector.wait_for(lambda spans: len(spans) == 4, 10)}
    assert set(spans) == {"iris-1", "iris-2", "tensorx", "partner"}
    # Own providers and a third party trusted with the client's identity get the span as parent.
    for name in ("iris-1", "iris-2", "partner"):
        assert sent[name]["traceparent"].split("-")[1:3] == [spans[name].trace_id, spans[name].span_id]
    assert sent["tensorx"] == {}
    assert (spans["iris-1"].attributes["server.address"], spans["iris-1"].attributes["server.port"]) == ("iris-1.example", 8443)
    assert "server.address" not in spans["iris-2"].attributes  # a pool: Envoy picks the replica
    assert spans["iris-1"].name == "text_completion m" and spans["iris-1"].attributes["gen_ai.operation.name"] == "text_completion"
    assert "gen_ai.conversation.id" not in spans["iris-1"].attributes  # no session
    assert (spans["iris-2"].status, spans["iris-2"].attributes["error.type"]) == ("ERROR", "503")
    assert spans["tensorx"].attributes["iris.routing.provider_kind"] == "unlimited"


def test_a_trace_started_here_follows_the_sample_ratio_and_a_client_trace_its_flag(collector):
    tracer, providers = tracer_for(collector, sample_ratio=0.0)
    unsampled = tracer.start(None, "chat", "m")
    context = tracer.routed(unsampled, providers["iris-1"], "new_pin", "s", 0.1)
    tracer.finish(unsampled, 200)
    assert int(context["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0  # propagated, not sampled (bit 0)
    sampled = tracer.start({"traceparent": CLIENT}, "chat", "m")
    tracer.routed(sampled, providers["iris-1"], "pinned", "s", 0.1)
    tracer.finish(sampled, None)
    tracer.shutdown()
    (span,) = collector.spans()
    assert (span.trace_id, span.parent_span_id) == (CLIENT.split("-")[1], CLIENT.split("-")[2])
    assert (span.status, span.attributes["error.type"]) == ("ERROR", "incomplete")


# What xds-protos leaves at opentelemetry-proto's paths when it is installed last: its common.proto
# predates the InstrumentationLibrary -> InstrumentationScope rename (grpc/grpc#42926).
STALE_PROTO = """
import sys
from opentelemetry.proto.common.v1 import common_pb2 as stale
del stale.InstrumentationScope
from extproc.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_serve_refuses_tracing_whose_exporter_meets_xds_protos_stale_copy(tmp_path):
    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump(small_config_data("redis://127.0.0.1:1/0", server={"listen": "127.0.0.1:1"},
                                                       tracing={"otlp_endpoint": "http://127.0.0.1:1"})))
    env = {**os.environ, "IRIS_SESSION_SECRET": secrets.token_hex(32)}
    result = subprocess.run([sys.executable, "-c", STALE_PROTO, "serve", "--config", str(config), "--workers", "2"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("iris-extproc: tracing.otlp_endpoint is set but the OTLP exporter cannot be imported "
                           "(cannot import name 'InstrumentationScope'")
    assert line.endswith(f"reinstall it last, pip install --force-reinstall --no-deps opentelemetry-proto=={version('opentelemetry-proto')}")
