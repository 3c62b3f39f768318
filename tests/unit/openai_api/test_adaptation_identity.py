"""What of the client's identity a request keeps for each provider (issue 20, item 10): a third
party (an unlimited provider) loses the identity headers, the session and agent session headers
and the body's `user` and `safety_identifier`; an own provider, and a third party that opts in
with `forward_client_identity`, keep them. The body is written again only when something in it
changes."""

from __future__ import annotations

import orjson

from extproc.config import DEFAULT_PRIVATE_HEADERS, parse_config
from extproc.config.schema import DEFAULT_AGENT_SESSION_HEADERS
from extproc.openai_api.adaptation import RequestAdapter
from tests.support.configs import small_config_data

IDENTITY_FIELDS = ("user", "safety_identifier")  # the body fields that name the client
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "user": "end-user-1", "safety_identifier": "sid-1", "stream": True}


def adapter_and_config(**tensorx):
    data = small_config_data(session={"trusted_identity_headers": ["x-iris-user"], "session_headers": ["x-session-id", "x-conv"]})
    data["providers"][2].update(tensorx)
    config = parse_config(data)
    return RequestAdapter(config, environ={}), config


def test_a_third_party_loses_every_identity_header_and_body_field():
    adapter, config = adapter_and_config()
    change = adapter.adapt(config.provider("tensorx"), "m", BODY, session_id="s")
    expected = {*DEFAULT_PRIVATE_HEADERS, "x-iris-user", "x-session-id", "x-conv", *DEFAULT_AGENT_SESSION_HEADERS}
    assert expected <= set(change.remove) and "x-envoy-external-address" in change.remove
    assert len(change.remove) == len(set(change.remove))  # each once
    sent = orjson.loads(change.body)
    assert sent == {name: value for name, value in BODY.items() if name not in IDENTITY_FIELDS}
    assert list(sent) == ["model", "messages", "stream"]  # the order of the client's fields is kept
    assert change.set_headers == {}  # an unlimited provider gets no affinity key


def test_an_own_provider_keeps_them_and_its_body_is_untouched():
    adapter, config = adapter_and_config()
    change = adapter.adapt(config.provider("iris-1"), "m", BODY, session_id="s")
    assert change.remove == ["authorization", "api-key", "x-api-key"]
    assert change.body is None  # nothing changed: Envoy sends the client's bytes as they were


def test_a_third_party_that_opts_in_is_treated_as_an_own_provider():
    adapter, config = adapter_and_config(forward_client_identity=True)
    change = adapter.adapt(config.provider("tensorx"), "m", BODY)
    assert change.remove == ["authorization", "api-key", "x-api-key"]
    assert change.body is None


def test_the_body_is_written_again_only_when_something_changes():
    adapter, config = adapter_and_config()
    tensorx = config.provider("tensorx")
    plain = {"model": "m", "messages": []}
    assert adapter.adapt(tensorx, "m", plain).body is None  # no identity field, no new name
    only_user = adapter.adapt(tensorx, "m", {**plain, "user": None}).body
    assert orjson.loads(only_user) == plain  # a null user is dropped too
    renamed_adapter, renamed_config = adapter_and_config(models={"m": {"features": ["chat"], "upstream_model": "vendor-m"}})
    renamed = renamed_adapter.adapt(renamed_config.provider("tensorx"), "m", BODY).body
    assert orjson.loads(renamed) == {"model": "vendor-m", "messages": BODY["messages"], "stream": True}
    assert orjson.loads(renamed_adapter.adapt(renamed_config.provider("tensorx"), "m", plain).body) == {**plain, "model": "vendor-m"}
    opted_adapter, opted_config = adapter_and_config(
        forward_client_identity=True, models={"m": {"features": ["chat"], "upstream_model": "vendor-m"}}
    )
    opted = orjson.loads(opted_adapter.adapt(opted_config.provider("tensorx"), "m", BODY).body)
    assert opted == {**BODY, "model": "vendor-m"}  # renamed, identity kept


def test_the_opt_in_defaults_to_false():
    _, config = adapter_and_config()
    assert [p.forward_client_identity for p in config.providers] == [False, False, False]
