"""The client's model name put back into answers (extproc.openai_api.renaming): JSON and event
streams, however the stream is cut into chunks, and nothing but the model members."""

from __future__ import annotations

import orjson
import pytest

from extproc.openai_api.renaming import MAX_HELD_BYTES, ModelNameRewriter

UPSTREAM, CLIENT = "tensorx/llama-3.1-70b-instruct", "llama-3.1-70b"


def whole(body: bytes, event_stream: bool = False) -> bytes:
    return ModelNameRewriter(UPSTREAM, CLIENT, event_stream).feed(body, True)


def test_a_json_answer_gets_the_clients_name_top_level_and_nested():
    chat = orjson.dumps({"id": "c", "model": UPSTREAM, "choices": []})
    assert orjson.loads(whole(chat))["model"] == CLIENT
    response = orjson.dumps({"type": "response.created", "response": {"id": "r", "model": UPSTREAM}})
    assert orjson.loads(whole(response))["response"]["model"] == CLIENT


@pytest.mark.parametrize(("member", "expected"), [
    (b'"model": "tensorx/llama-3.1-70b-instruct"', b'"model": "llama-3.1-70b"'),
    (b'"model" :\n\t"tensorx\\/llama-3.1-70b-instruct"', b'"model" :\n\t"llama-3.1-70b"'),
])
def test_whitespace_and_an_escaped_slash_are_json_too(member, expected):
    assert whole(b'{"id":"x", ' + member + b'}') == b'{"id":"x", ' + expected + b'}'


def test_only_model_members_holding_the_upstream_name_change():
    content = "quoting {\"model\": \"tensorx/llama-3.1-70b-instruct\"} in text"
    body = orjson.dumps({"model": UPSTREAM, "content": content, "other": UPSTREAM, "x": {"model": "tensorx/other"}})
    assert orjson.loads(whole(body)) == {"model": CLIENT, "content": content, "other": UPSTREAM, "x": {"model": "tensorx/other"}}
    plain = orjson.dumps({"model": CLIENT})
    assert whole(plain) is plain  # nothing to do: the very same bytes, no copy


def test_an_event_stream_is_rewritten_however_it_is_cut():
    events = b"".join(b"data: " + orjson.dumps({"id": "c", "model": UPSTREAM, "n": i}) + b"\n\n" for i in range(3)) + b"data: [DONE]\n\n"
    expected = events.replace(UPSTREAM.encode(), CLIENT.encode())
    for cut in range(1, len(events)):
        rewriter = ModelNameRewriter(UPSTREAM, CLIENT, event_stream=True)
        first = rewriter.feed(events[:cut], False)
        assert first.endswith(b"\n") or first == b""  # a partial line waits
        assert first + rewriter.feed(events[cut:], True) == expected, cut
    assert rewriter.rewritten == 3


def test_a_long_line_without_a_newline_is_not_held_forever():
    rewriter = ModelNameRewriter(UPSTREAM, CLIENT, event_stream=True)
    long_line = b"data: " + b"x" * (MAX_HELD_BYTES + 1)
    assert rewriter.feed(long_line, False) == long_line
    assert rewriter.feed(b"\n\n", True) == b"\n\n"


def test_a_client_name_with_json_escapes_stays_valid_json():
    odd = 'm\\"1'
    body = orjson.dumps({"model": UPSTREAM})
    assert orjson.loads(ModelNameRewriter(UPSTREAM, odd, False).feed(body, True)) == {"model": odd}


def test_a_streamed_json_answer_is_rewritten_however_it_is_cut():
    """A JSON answer too large for Envoy to buffer comes STREAMED: a member cut anywhere, even
    after a backslash of `\\/`, or right after its closing quote, is held back until it is whole;
    quoted text stays as it is."""
    item = {"quote": '"model": "tensorx/llama-3.1-70b-instruct" \\', "model": UPSTREAM, "other": UPSTREAM}
    body = (b'{"model" :  "tensorx\\/llama-3.1-70b-instruct", "data": ['
            + b",".join(orjson.dumps(item) for _ in range(30)) + b'], "model": "' + UPSTREAM.encode() + b'"}')
    expected = whole(body)
    assert expected.count(b'"model":"llama-3.1-70b"') == 30 and orjson.loads(expected)["model"] == CLIENT
    for size in (1, 2, 3, 7, 11, 40, 97, 500):
        rewriter = ModelNameRewriter(UPSTREAM, CLIENT, event_stream=False)
        chunks = [body[i:i + size] for i in range(0, len(body), size)]
        out = b"".join(rewriter.feed(chunk, i == len(chunks) - 1) for i, chunk in enumerate(chunks))
        assert out == expected, size
        assert rewriter.rewritten == 32


def test_a_streamed_json_answer_is_held_back_no_more_than_a_member():
    rewriter = ModelNameRewriter(UPSTREAM, CLIENT, event_stream=False)
    assert rewriter.feed(b'{"data": [1, 2, 3], "x": "model"', False) == b'{"data": [1, 2, 3], "x": '  # a member's name?
    assert rewriter.feed(b', "model": "tensorx/llama', False) == b'"model", '  # no; this one waits whole
    assert rewriter.feed(b'-3.1-70b-instruct"}', True) == b'"model": "llama-3.1-70b"}'
    other = ModelNameRewriter(UPSTREAM, CLIENT, event_stream=False)
    assert other.feed(b'{"model": "tensorx/other", "data": [0', False) == b'{"model": "tensorx/other", "data": [0'
