"""What the client of a first-token stream holds, and each backend's events rewritten for it.

``recovery.py`` streams a first-token answer (``first_token.py``): P's token
first, then one or more *legs*: D's stream (D loads the prompt's KV from P)
and, should D fail, the stream of a backend asked again to continue
(``first_token.continuation_body``). A :class:`DeliveredStream` sees every
event of every leg before the client does. It rewrites the event (P's id, the
client's prompt, the tokens moved into the backend's prompt counted as output)
and keeps what the client has received:
the token ids, whether the answer has finished, and up to where the text is
whole.

Where a new leg may start: after a token whose text the client has whole. A
detokenizer holding back the bytes of half a character (a byte token of a
byte-level BPE) shows nothing for that token, and one primed with a prompt
ending there renders the prompt's text in front of its first token
(``first_token.take`` says more). An event with one token whose text is not
empty and holds no U+FFFD ends whole; one with several tokens (vLLM merges the
deltas of a client that lags) may end inside a character, and tells nothing.
So a leg starts after the last whole point and generates again the tokens
after it, which must equal those sent, and whose text is not sent again::

    client holds:  t1 | t2 t3 t4 | t5      (t2..t4 came in one event; t5's text "")
                   whole        ^ after t1 only: t2..t4 tell nothing, t5 is half a character
    next leg:      prompt + t1 -> t2 t3 t4 t5 (checked, not sent again) t6 ... (sent)

A greedy answer allows that (the same tokens come again); a sampled one only
when nothing needs generating again. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbridge.proxy.first_token import FirstToken, fix_usage, sampled

__all__ = ["DeliveredStream", "ResumePoint", "StreamBroken"]


class StreamBroken(Exception):
    """A leg cannot go on: an error event, an event that is not a completion's, or
    tokens other than those the client already holds."""


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where the next leg starts.

    Attributes:
        done_ids: the answer's tokens that join the next leg's prompt (P's first).
        skip_ids: tokens the client holds that the next leg generates again.
        skip_text: the text the client holds for ``skip_ids``.
    """

    done_ids: list[int]
    skip_ids: list[int]
    skip_text: str


@dataclass(slots=True)
class _Leg:
    num_moved: int  # answer tokens in this leg's prompt
    skip_ids: list[int] = field(default_factory=list)
    skip_text: str = ""
    first: bool = False  # D's leg, whose first event names the prompt


class DeliveredStream:
    """The client's view of one first-token stream; P's token has been sent.

    Args:
        body: The client's request.
        first: P's token.
    """

    def __init__(self, body: dict[str, Any], first: FirstToken) -> None:
        self._first = first
        self._wants_ids = bool(body.get("return_token_ids"))
        self._wants_usage = isinstance(body.get("stream_options"), dict) and bool(
            body["stream_options"].get("include_usage"))
        self._sampled = sampled(body)
        self.sent_ids = [first.token_id]  # P's token passed first_token.take: whole
        self._num_whole = 1
        self._text_after_whole = ""
        self.finished = False
        self._usage_sent = False
        self._leg = _Leg(num_moved=1, first=True)

    def resume_point(self) -> ResumePoint | None:
        """Where a new leg would start; None when none may (sampled, text not whole)."""
        skip_ids = self.sent_ids[self._num_whole:]
        if skip_ids and self._sampled:
            return None
        return ResumePoint(self.sent_ids[:self._num_whole], skip_ids, self._text_after_whole)

    def start_leg(self, point: ResumePoint) -> None:
        """The next events come from a backend asked to continue from ``point``."""
        self._leg = _Leg(len(point.done_ids), list(point.skip_ids), point.skip_text)

    def accept(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The client's version of one of the leg's events (None: nothing left to send).

        Raises:
            StreamBroken: as the class says; nothing of ``event`` was taken.
        """
        if "error" in event:
            error = event["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise StreamBroken(f"an error event: {str(message)[:300]}")
        choices = event.get("choices")
        if not isinstance(choices, list) or len(choices) > 1:
            raise StreamBroken(f"an event without one choice: {str(event)[:200]}")
        out = dict(event)
        if "id" in out and self._first.answer.get("id") is not None:
            out["id"] = self._first.answer["id"]
        keep = True
        if choices:
            choice, emptied = self._choice(choices[0])
            out["choices"] = [choice]
            keep = not emptied
        if isinstance(event.get("usage"), dict):
            out["usage"] = dict(event["usage"])
            fix_usage(out["usage"], self._leg.num_moved)
            self._usage_sent = self._usage_sent or not choices
            keep = True
        return out if keep else None

    def _choice(self, choice: object) -> tuple[dict[str, Any], bool]:
        """The client's choice, and whether skipping what it holds left nothing to send."""
        if not isinstance(choice, dict):
            raise StreamBroken(f"a choice that is not an object: {str(choice)[:200]}")
        ids, text = choice.get("token_ids"), choice.get("text")
        if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)
                and isinstance(text, str)):
            raise StreamBroken(f"a choice without token ids and text: {str(choice)[:200]}")
        leg = self._leg
        new_ids, new_text = self._skip(ids, text)
        finished = choice.get("finish_reason") is not None
        if finished and (leg.skip_ids or leg.skip_text):
            raise StreamBroken(f"finished before the {len(leg.skip_ids)} tokens the client "
                               f"holds came again")
        self.sent_ids += new_ids
        if len(ids) == 1 and new_ids and new_text and "\ufffd" not in new_text:
            self._num_whole, self._text_after_whole = len(self.sent_ids), ""
        else:
            self._text_after_whole += new_text
        self.finished = self.finished or finished
        out = {**choice, "text": new_text, "token_ids": new_ids}
        if isinstance(choice.get("prompt_token_ids"), list):  # names the backend's prompt
            wants_prompt = self._wants_ids and leg.first
            out["prompt_token_ids"] = self._first.prompt_ids if wants_prompt else None
        emptied = len(new_ids) < len(ids) and not (new_ids or new_text or finished)
        return out, emptied

    def _skip(self, ids: list[int], text: str) -> tuple[list[int], str]:
        """``ids`` and ``text`` less what the client holds already; checks they match it."""
        leg = self._leg
        num_skipped = min(len(leg.skip_ids), len(ids))
        if ids[:num_skipped] != leg.skip_ids[:num_skipped]:
            raise StreamBroken(f"tokens {ids[:num_skipped]} came again where the client "
                               f"holds {leg.skip_ids[:num_skipped]}")
        leg.skip_ids = leg.skip_ids[num_skipped:]
        if leg.skip_text:
            if text.startswith(leg.skip_text):
                text, leg.skip_text = text[len(leg.skip_text):], ""
            elif leg.skip_text.startswith(text):
                text, leg.skip_text = "", leg.skip_text[len(text):]
            else:
                raise StreamBroken(f"text {text[:50]!r} came again where the client holds "
                                   f"{leg.skip_text[:50]!r}")
        return ids[num_skipped:], text

    def tail(self) -> list[dict[str, Any]]:
        """What a finished answer still owes the client when its leg broke before the end:
        the usage event, if the client asked for one and has not had it."""
        if not (self.finished and self._wants_usage and not self._usage_sent):
            return []
        num_prompt, num_output = len(self._first.prompt_ids), len(self.sent_ids)
        usage = {"prompt_tokens": num_prompt, "completion_tokens": num_output,
                 "total_tokens": num_prompt + num_output}
        event = {key: self._first.answer.get(key) for key in ("id", "created", "model")}
        event.update(object="text_completion", choices=[], usage=usage)
        self._usage_sent = True
        return [event]
