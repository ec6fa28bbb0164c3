"""Where a first-token stream may be resumed, and a resumed leg checked against what the
client holds (``kvbridge/proxy/continuation.py``, pure)."""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.proxy.continuation import DeliveredStream, ResumePoint, StreamBroken
from kvbridge.proxy.first_token import FirstToken

FIRST = FirstToken(answer={"id": "cmpl-p", "choices": []}, token_id=10, text="x",
                   prompt_ids=[1, 2], finished=False)
GREEDY = {"prompt": [1, 2], "max_tokens": 9, "temperature": 0.0}


def event(ids: list[int], text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "cmpl-d", "choices": [{"index": 0, "text": text, "token_ids": ids,
                                         "finish_reason": finish}]}


def test_a_leg_may_start_only_where_the_clients_text_is_whole() -> None:
    stream = DeliveredStream(GREEDY, FIRST)
    assert stream.resume_point() == ResumePoint([10], [], "")  # P's token is whole
    stream.accept(event([11, 12], "ab"))  # two tokens: the second may be half a character
    assert stream.resume_point() == ResumePoint([10], [11, 12], "ab")
    stream.accept(event([13], ""))  # half a character
    assert stream.resume_point() == ResumePoint([10], [11, 12, 13], "ab")
    stream.accept(event([14], "é"))  # one token, its text whole: all is shown
    assert stream.resume_point() == ResumePoint([10, 11, 12, 13, 14], [], "")
    stream.accept(event([15], "\ufffd"))
    assert stream.resume_point() == ResumePoint([10, 11, 12, 13, 14], [15], "\ufffd")
    # sampled: the tokens after the last whole one would not come again
    sampled = DeliveredStream({**GREEDY, "temperature": 0.7}, FIRST)
    sampled.accept(event([11], "a"))
    assert sampled.resume_point() == ResumePoint([10, 11], [], "")
    sampled.accept(event([12, 13], "bc"))
    assert sampled.resume_point() is None


def resumed() -> DeliveredStream:
    """A stream that broke after [11, 12] "ab" in one event; its next leg starts after P's."""
    stream = DeliveredStream(GREEDY, FIRST)
    stream.accept(event([11, 12], "ab"))
    point = stream.resume_point()
    assert point is not None
    stream.start_leg(point)
    return stream


def test_a_resumed_leg_sends_only_what_the_client_lacks() -> None:
    stream = resumed()
    assert stream.accept(event([11], "a")) is None  # held already: nothing sent
    out = stream.accept(event([12, 13], "bc"))
    assert out is not None and out["id"] == "cmpl-p"
    assert (out["choices"][0]["token_ids"], out["choices"][0]["text"]) == ([13], "c")
    out = stream.accept({"id": "cmpl-d", "choices": [],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 3}})
    assert out is not None and out["usage"] == {"prompt_tokens": 2, "completion_tokens": 4}
    assert stream.sent_ids == [10, 11, 12, 13]


@pytest.mark.parametrize("bad, words", [
    (event([11], "z"), "text 'z' came again where the client holds 'ab'"),
    (event([99], "a"), "tokens [99] came again where the client holds [11]"),
    (event([11], "a", finish="length"), "finished before the 1 tokens the client holds"),
    ({"error": {"message": "KV load failed"}}, "an error event: KV load failed"),
    ({"choices": [{"text": "a"}]}, "a choice without token ids and text"),
])
def test_a_leg_that_differs_from_what_the_client_holds_is_refused(
        bad: dict[str, Any], words: str) -> None:
    stream = resumed()
    with pytest.raises(StreamBroken, match=words.replace("[", r"\[").replace("]", r"\]")):
        stream.accept(bad)
    assert stream.sent_ids == [10, 11, 12]  # nothing of it taken


def test_a_finished_answer_whose_stream_broke_still_gets_its_usage() -> None:
    stream = DeliveredStream({**GREEDY, "stream_options": {"include_usage": True}}, FIRST)
    stream.accept(event([11], "a", finish="length"))
    assert stream.finished
    [usage_event] = stream.tail()
    assert usage_event["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                    "total_tokens": 4}
    assert stream.tail() == []
