"""Identity and session keys (extproc.openai_api.sessions), response-id reading (extproc.openai_api.chains) and the
identity headers kept from third parties (extproc.openai_api.adaptation): no gateway needed."""

from __future__ import annotations

import orjson
import pytest

from extproc.config import ConfigError, SessionSignal, parse_config
from extproc.openai_api.adaptation import RequestAdapter
from extproc.openai_api.chains import MAX_SCAN_BYTES, ResponseIdReader
from extproc.openai_api.request import parse_request
from extproc.openai_api.sessions import SessionKeys
from tests.support.configs import small_config_data

SECRET = b"s3cret"


def keys(**session) -> SessionKeys:
    return SessionKeys(parse_config({**small_config_data(), "session": session}), SECRET)


def chat(first: str = "hello", **fields) -> object:
    body = {"model": "m", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": first}], **fields}
    return parse_request("chat", orjson.dumps(body), 2048)


def responses(**fields) -> object:
    return parse_request("responses", orjson.dumps({"model": "m", "input": "hi", **fields}), 2048)


def session(k: SessionKeys, request, headers: dict | None = None, chained: str | None = None):
    signals = k.read_headers(headers or {})
    return k.session(signals, request, k.identity(signals, request), chained)


def test_identity_sources_in_their_order_and_a_header_counts_only_when_trusted():
    untrusted = keys()
    trusted = keys(trusted_identity_headers=["x-iris-user"])
    headers = {"x-iris-user": "alice", "x-user-id": "mallory", "authorization": "Bearer sk-alice"}
    assert trusted.identity(trusted.read_headers(headers), chat()) == "trusted_header:alice"
    from_key = untrusted.identity(untrusted.read_headers(headers), chat())
    assert from_key.startswith("credential:") and "sk-alice" not in from_key
    assert from_key == untrusted.identity(untrusted.read_headers({"authorization": "Bearer sk-alice"}), chat())
    assert untrusted.identity(untrusted.read_headers({"x-user-id": "mallory"}), chat(user="u1")) == "body:u1"
    assert untrusted.identity(untrusted.read_headers({}), chat(user="u1", safety_identifier="h1")) == "body:h1"
    assert untrusted.identity(untrusted.read_headers({"x-user-id": "mallory"}), chat()) == ""
    body_first = keys(identity_sources=["body", "credential"])
    assert body_first.identity(body_first.read_headers(headers), chat(user="u1")) == "body:u1"


def test_two_identities_with_the_same_opening_message_get_different_sessions():
    k = keys()
    alice = session(k, chat(), {"authorization": "Bearer a"})
    bob = session(k, chat(), {"authorization": "Bearer b"})
    assert alice.signal is bob.signal is SessionSignal.PREFIX
    assert alice.session_id != bob.session_id
    assert alice.session_id == session(k, chat(), {"authorization": "Bearer a"}).session_id


def test_the_strongest_signal_present_decides_in_the_configured_order():
    k = keys()
    agent = {"x-claude-code-session-id": "cc-1"}
    explicit = {"x-session-id": "s-1", **agent}
    assert session(k, chat(), explicit).signal is SessionSignal.SESSION_HEADER
    assert session(k, chat(prompt_cache_key="pk"), agent).signal is SessionSignal.PROMPT_CACHE_KEY
    assert session(k, chat(), agent).signal is SessionSignal.AGENT_HEADERS
    assert session(k, chat(), {"session_id": "codex-1"}).signal is SessionSignal.AGENT_HEADERS
    assert session(k, responses(conversation={"id": "conv_1"}), agent).signal is SessionSignal.CONVERSATION
    assert session(k, responses(previous_response_id="resp_1"), agent, chained="abc") == session(
        k, responses(), {}, chained="abc"
    )
    chained = session(k, responses(previous_response_id="resp_1"), agent, chained="abc")
    assert (chained.signal, chained.session_id) == (SessionSignal.PREVIOUS_RESPONSE_ID, "abc")
    assert session(k, responses(previous_response_id="resp_1"), agent).signal is SessionSignal.AGENT_HEADERS
    prefix_only = keys(signals=["prefix"])
    assert session(prefix_only, chat(prompt_cache_key="pk"), explicit).signal is SessionSignal.PREFIX
    embeddings = parse_request("embeddings", orjson.dumps({"model": "m", "input": "x"}), 2048)
    assert session(k, embeddings, explicit).session_id is None


def test_an_explicit_key_is_one_session_whatever_the_prompt_but_scoped_by_identity_and_model():
    k = keys()
    first = session(k, chat("one", prompt_cache_key="pk"), {"authorization": "Bearer a"})
    assert first.session_id == session(k, chat("two", prompt_cache_key="pk"), {"authorization": "Bearer a"}).session_id
    assert first.session_id != session(k, chat("one", prompt_cache_key="pk"), {"authorization": "Bearer b"}).session_id
    other_model = parse_request("chat", orjson.dumps({"model": "n", "messages": [{"role": "user", "content": "x"}],
                                                      "prompt_cache_key": "pk"}), 2048)
    assert first.session_id != session(k, other_model, {"authorization": "Bearer a"}).session_id
    via_header = session(k, chat("one"), {"authorization": "Bearer a", "x-session-id": "pk"})
    assert via_header.session_id != first.session_id  # a signal is part of the key
    assert len(first.session_id) == 32 and "pk" not in first.session_id


def test_outranking_previous_response_follows_the_configured_order():
    k = keys()
    assert k.outranks_previous_response(SessionSignal.PROMPT_CACHE_KEY)
    assert not k.outranks_previous_response(SessionSignal.AGENT_HEADERS)
    assert not k.outranks_previous_response(SessionSignal.PREFIX)
    assert not k.outranks_previous_response(None)
    assert keys(signals=["agent_headers", "previous_response_id"]).outranks_previous_response(SessionSignal.AGENT_HEADERS)


def test_bad_session_settings_are_rejected_with_their_field():
    with pytest.raises(ConfigError) as bad:
        parse_config({**small_config_data(), "session": {"signals": ["prefix", "prefix"], "trusted_identity_headers": ["authorization"]}})
    assert "session.signals: holds a value twice" in bad.value.problems
    assert any(p.startswith("session.trusted_identity_headers:") for p in bad.value.problems)
    with pytest.raises(ConfigError):
        parse_config({**small_config_data(), "session": {"signals": ["gut_feeling"]}})


def test_a_json_answer_gives_its_id_and_anything_else_gives_none():
    reader = ResponseIdReader(event_stream=False)
    assert reader.feed(b'{"id": "resp_', False) is None and not reader.done
    assert reader.feed(b'1", "object": "response"}', True) == "resp_1" and reader.done
    assert ResponseIdReader(False).feed(b"not json", True) is None
    assert ResponseIdReader(False).feed(b'["resp_1"]', True) is None
    assert ResponseIdReader(False).feed(b'{"id": 7}', True) is None


def test_an_event_stream_gives_the_id_of_its_first_event_even_split_across_chunks():
    created = b'event: response.created\r\ndata: {"type":"response.created","response":{"id":"resp_9","status":"in_progress"}}\r\n\r\n'
    reader = ResponseIdReader(event_stream=True)
    assert reader.feed(created[:40], False) is None and not reader.done
    assert reader.feed(created[40:] + b"data: {}\n\n", False) == "resp_9" and reader.done
    assert reader.feed(b"more", False) is None
    not_created = ResponseIdReader(True)
    assert not_created.feed(b'data: {"type":"error"}\n\n', False) is None and not_created.done
    endless = ResponseIdReader(True)
    endless.feed(b"data: " + b"x" * (MAX_SCAN_BYTES + 1), False)
    assert endless.done and endless.response_id is None


def test_third_parties_lose_identity_cookies_and_forwarded_for_own_providers_keep_them():
    config = parse_config({**small_config_data(), "session": {"trusted_identity_headers": ["x-iris-user"]}})
    adapter = RequestAdapter(config, environ={})
    by_kind = {p.kind.value: p for p in config.providers}
    third_party = adapter.adapt(by_kind["unlimited"], "m", {"model": "m"}).remove
    for header in ("authorization", "cookie", "x-forwarded-for", "forwarded", "x-real-ip", "x-user-id", "x-iris-user"):
        assert header in third_party
    own = adapter.adapt(by_kind["managed"], "m", {"model": "m"}).remove
    assert "authorization" in own and "cookie" not in own and "x-forwarded-for" not in own
