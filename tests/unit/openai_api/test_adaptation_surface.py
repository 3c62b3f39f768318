"""What else a request loses or keeps on its way to a provider (issue 29, item 16): a request
without a session loses the client's own copy of the header a provider's own router reads (so
no client picks its replica), and a body the router writes again keeps every integer as the
client wrote it, beyond 64 bits too (orjson alone reads those as floats)."""

from __future__ import annotations

import json

import orjson
import pytest

from extproc.config import parse_config
from extproc.openai_api.adaptation import RequestAdapter, affinity_key, exact_integers
from tests.support.configs import small_config_data


def own_router_adapter(preset: str) -> tuple[RequestAdapter, object]:
    data = small_config_data()
    data["providers"][1].update(affinity="own_router", router_session_header=preset)
    config = parse_config(data)
    return RequestAdapter(config, environ={}), config.provider("iris-2")


@pytest.mark.parametrize("preset, header", [("sglang", "x-smg-routing-key"), ("llm-d", "x-session-id"), ("dynamo", "x-dynamo-session-id")])
def test_a_request_without_a_session_loses_the_clients_copy_of_the_router_header(preset, header):
    adapter, provider = own_router_adapter(preset)
    sessionless = adapter.adapt(provider, "m", {"model": "m"})
    assert header in sessionless.remove and header not in sessionless.set_headers
    with_session = adapter.adapt(provider, "m", {"model": "m"}, session_id="s")
    assert with_session.set_headers[header] == affinity_key("s") and header not in with_session.remove  # overwrites the client's


def test_a_lookup_without_a_session_loses_it_too():
    adapter, provider = own_router_adapter("sglang")
    assert "x-smg-routing-key" in adapter.adapt(provider, "m", None).remove


BIG = 2**64 + 5  # beyond what orjson reads as an integer (it reads 1.8446744073709552e+19)


def renaming_adapter():
    data = small_config_data()
    data["providers"][2]["models"]["m"]["upstream_model"] = "vendor-m"
    config = parse_config(data)
    return RequestAdapter(config, environ={}), config.provider("tensorx")


@pytest.mark.parametrize("raw", [
    f'{{"model": "m", "seed": {BIG}, "user": "u", "messages": [{{"role": "user", "content": "é ✓ 12345678901234567890"}}]}}',
    f'{{"model":"m","seed":-{BIG},"temperature":0.1,"n":1,"response_format":{{"json_schema":{{"maximum":{BIG * 10**30}}}}}}}',
])
def test_a_rewritten_body_keeps_every_integer_beyond_64_bits_exactly(raw):
    adapter, tensorx = renaming_adapter()
    raw = raw.encode()
    sent = adapter.adapt(tensorx, "m", orjson.loads(raw), raw=raw).body
    expected = {k: v for k, v in json.loads(raw).items() if k != "user"} | {"model": "vendor-m"}
    assert json.loads(sent) == expected  # the standard library reads integers exactly: nothing became a float
    assert str(BIG).encode() in sent and b"e+" not in sent


def test_a_body_without_a_long_integer_keeps_orjsons_writer():
    body = {"model": "m", "seed": 10**17, "text": "no run of 19 digits: 123456789012345678"}
    raw = orjson.dumps(body)
    assert exact_integers(raw, body) == (body, orjson.dumps)  # the common case pays one scan, no second reading
    assert exact_integers(None, body) == (body, orjson.dumps)
    largest = orjson.dumps({**body, "seed": 2**64 - 1})  # orjson's largest integer: read again, still exact
    assert exact_integers(largest, orjson.loads(largest))[0]["seed"] == 2**64 - 1
