"""Identity and session keys (extproc.openai_api.sessions), response-id reading (extproc.openai_api.chains) and the
identity headers kept from third parties (extproc.openai_api.adaptation): no gateway needed."""

from __future__ import annotations

import orjson
import pytest

from extproc.config import ConfigError, SessionSignal, parse_config
from extproc.openai_api.adaptation import RequestAdapter
from extproc.openai_api.chains import MAX_SCAN_BYTES, ResponseReader
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


def read(reader: ResponseReader, *chunks: bytes) -> tuple[str | None, str | None]:
    """Feed `chunks` (the last one ends the body) until the reader is done: (id, status)."""
    for index, chunk in enumerate(chunks):
        if reader.feed(chunk, index == len(chunks) - 1):
            break
    return reader.response_id, reader.status


def test_a_json_answer_gives_its_id_and_anything_else_gives_none():
    reader = ResponseReader(event_stream=False)
    assert not reader.feed(b'{"id": "resp_', False) and not reader.done
    assert reader.feed(b'1", "object": "response"}', True) and reader.done and reader.response_id == "resp_1"
    assert read(ResponseReader(False), b"not json") == (None, None)
    assert read(ResponseReader(False), b'["resp_1"]') == (None, None)
    assert read(ResponseReader(False), b'{"id": 7}') == (None, None)


def test_a_json_answer_gives_its_top_level_id_and_status_in_any_chunking_without_being_held_whole():
    answer = orjson.dumps({
        "object": "response", "instructions": 'quoting "id": "resp_fake", "status": "completed" \\',
        "output": [{"id": "msg_1", "status": "completed", "content": [{"id": "x"}]}], "metadata": {"status": "no"},
        "id": "resp_1", "status": "queued", "usage": None,
    })
    for size in (1, 2, 5, 64, len(answer)):
        chunks = [answer[i:i + size] for i in range(0, len(answer), size)]
        reader = ResponseReader(False)
        assert read(reader, *chunks) == ("resp_1", "queued") and reader.running
    # found before the end: the rest of a large answer is never held
    reader = ResponseReader(False)
    assert reader.feed(b'{"id": "resp_2", "status": "completed", "output": [' + b"0," * 100_000, False)
    assert (reader.response_id, reader.status, reader.running, len(reader.buffer)) == ("resp_2", "completed", False, 0)
    # not found within MAX_SCAN_BYTES: given up, with what was found
    late = ResponseReader(False)
    assert late.feed(b'{"id": "resp_3", "pad": "' + b"x" * MAX_SCAN_BYTES, False)
    assert (late.response_id, late.status) == ("resp_3", None)


def test_an_event_stream_gives_the_id_of_its_first_event_even_split_across_chunks():
    created = b'event: response.created\r\ndata: {"type":"response.created","response":{"id":"resp_9","status":"in_progress"}}\r\n\r\n'
    reader = ResponseReader(event_stream=True)
    assert not reader.feed(created[:40], False) and not reader.done
    assert reader.feed(created[40:] + b"data: {}\n\n", False) and (reader.response_id, reader.status) == ("resp_9", "in_progress")
    assert reader.feed(b"more", False) and reader.response_id == "resp_9"
    not_created = ResponseReader(True)
    assert not_created.feed(b'data: {"type":"error"}\n\n', False) and not_created.response_id is None
    endless = ResponseReader(True)
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
