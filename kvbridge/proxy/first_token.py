"""P's first token goes to the client: D continues from it instead of computing it again.

A P/D proxy asks P for one token (``max_tokens`` 1) so that P builds the
prompt's KV. P samples that token anyway; the classic flow (vLLM's toy proxy,
``NixlConnector``) throws it away and lets D compute it again from the loaded
KV, so the client waits for P *and* for D's first step before its first
token. Here the proxy sends P's token to the client as soon as P answers and
asks D for the rest, with the token appended to D's prompt::

    P: prompt                      -> t1        (KV of the prompt, held for D)
    D: prompt + [t1], max_tokens-1 -> t2 t3 ...  (loads the prompt's KV from P,
                                                 computes t1's position only)
    client: t1 (at P's answer), then t2 t3 ... as D streams them

D's answer is then exactly colocated decoding after t1: greedy answers equal a
single server's token for token. Only requests whose answer cannot depend on
where t1 was sampled take this path (:func:`plan`): one prompt, one choice,
no logprobs, echo, stop strings (one could span t1 and D's first token),
penalties on output tokens or structured output, no seed with sampling (D's
generator would start one token late), an explicit ``max_tokens`` >= 2, and
only keys known to be safe. Everything else takes the classic flow.

P must return its token ids (vLLM: ``return_token_ids``): an answer without
``choices[0].token_ids`` and ``prompt_token_ids`` falls back to the classic
flow for that request. So does an answer whose token's text is not whole
(:func:`take`): the text must also equal colocated, and a character whose
bytes span t1 and t2 comes out right only where one detokenizer sees both.
A streamed D is always asked for its token ids (:func:`continuation_body`),
whether the client asked or not (the client then gets them, as P's token
comes with its id): should D fail mid-answer, the proxy must know which
tokens the client holds to have the rest computed elsewhere
(``kvbridge/proxy/recovery.py``; the client's events are rewritten by
``continuation.py``). Pure functions; the proxy does the HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FirstToken",
    "continuation_body",
    "covers_prompt",
    "decode_body",
    "first_event",
    "fix_usage",
    "merge_answer",
    "only_first",
    "plan",
    "prefill_body",
    "release_body",
    "sampled",
    "take",
]

# Keys whose meaning does not change when t1 moves from D's output to its prompt.
_SAFE_KEYS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stream",
    "stream_options", "ignore_eos", "stop_token_ids", "min_tokens", "repetition_penalty",
    "skip_special_tokens", "spaces_between_special_tokens", "return_token_ids", "user",
    "seed", "n", "best_of", "echo", "logprobs", "stop", "kv_transfer_params",
    "include_stop_str_in_output", "presence_penalty", "frequency_penalty",
})


def plan(body: dict[str, Any]) -> bool:
    """Whether this completion request may take the first-token path."""
    if not body.keys() <= _SAFE_KEYS:
        return False
    prompt = body.get("prompt")
    single = isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
    max_tokens = body.get("max_tokens")
    return (
        single
        and isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 2
        and body.get("n", 1) in (1, None) and body.get("best_of", 1) in (1, None)
        and not body.get("echo") and body.get("logprobs") is None and not body.get("stop")
        and not body.get("presence_penalty") and not body.get("frequency_penalty")
        and not (sampled(body) and body.get("seed") is not None)
        # vLLM then writes a special token right after another without its
        # leading space, knowing "after another" from its output only: t1 would
        # be in D's prompt.
        and not (body.get("skip_special_tokens") is False
                 and body.get("spaces_between_special_tokens") is False)
    )


def sampled(body: dict[str, Any]) -> bool:
    """Whether the request samples (vLLM's completions default to temperature 1)."""
    return bool(body.get("temperature", 1.0) != 0)


def prefill_body(body: dict[str, Any], first_token: bool) -> dict[str, Any]:
    """What P is asked: one token, not streamed, blocks kept for D (and its token ids)."""
    params: dict[str, Any] = {"do_remote_decode": True}
    if first_token:  # P computes the whole prompt (a state model's P stops short otherwise)
        params["first_token_flow"] = True
    p_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}
    if "max_completion_tokens" in body:  # chat: it wins over max_tokens
        p_body["max_completion_tokens"] = 1
    p_body.pop("stream_options", None)  # refused by vLLM without stream
    if isinstance(body.get("min_tokens"), int):
        p_body["min_tokens"] = min(body["min_tokens"], 1)  # no EOS as t1 if the client said so
    if first_token:
        p_body["return_token_ids"] = True
    return p_body


@dataclass(frozen=True, slots=True)
class FirstToken:
    """P's answer, for the client and for D.

    Attributes:
        answer: P's JSON answer.
        token_id: the token P sampled.
        text: its text.
        prompt_ids: the prompt's token ids as P saw them.
        finished: P's token ended the request (EOS or a stop token): D only
            needs to be told to let P's blocks go.
    """

    answer: dict[str, Any]
    token_id: int
    text: str
    prompt_ids: list[int]
    finished: bool


def take(answer: dict[str, Any]) -> FirstToken | None:
    """P's token from its answer, or None (classic flow).

    None when the answer lacks the token ids, or when P's token did not end the
    request and its text is not whole: empty or holding U+FFFD.

    Why the text decides: P's detokenizer (vLLM's incremental one, fast or
    slow) shows nothing for a token whose bytes end inside a UTF-8 character
    (a byte token of a byte-level BPE, say) and keeps them for the next token,
    which P never makes. D, asked for the rest with t1 at the end of its
    prompt, starts its detokenizer on that prompt, and one primed with ids
    that end inside a character renders the prompt's text (all of it, or from
    its last whole character on) in front of t2's: the client would get the
    prompt's text. An empty text is also what a skipped special token shows;
    the classic flow is right for it too (D samples t1 and renders t1 and t2
    together, as colocated). Measured on both of vLLM 0.32's detokenizers over
    random byte-level prompts and answers: whenever P's text is not empty, P's
    text followed by D's equals a colocated answer's.

    A token that ended the request (EOS or a stop token): P's answer is the
    client's as it is, the same one a colocated server gives, whatever its text.
    """
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    ids, prompt_ids = choice.get("token_ids"), choice.get("prompt_token_ids")
    text = choice.get("text")
    if not (isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], int)
            and isinstance(prompt_ids, list) and prompt_ids
            and all(isinstance(t, int) for t in prompt_ids) and isinstance(text, str)):
        return None
    finished = choice.get("finish_reason") == "stop"
    if not finished and (not text or "\ufffd" in text):
        return None
    return FirstToken(answer, ids[0], text, prompt_ids, finished)


def covers_prompt(first: FirstToken, params: dict[str, Any] | None) -> bool:
    """Whether P's params hold the KV of the whole prompt P sampled ``first`` after.

    A P that stopped short of the prompt (vLLM's NixlConnector does so for a
    model with a recurrent state, for D to recompute the last prompt token)
    sampled its token after part of it: that token is not the prompt's
    answer, and the classic flow must run.
    """
    num_tokens = params.get("remote_num_tokens") if params is not None else None
    return not isinstance(num_tokens, int) or num_tokens >= len(first.prompt_ids)


def decode_body(body: dict[str, Any], first: FirstToken, params: dict[str, Any] | None
                ) -> dict[str, Any]:
    """What D is asked: the rest of the answer after P's token."""
    return continuation_body(body, first, [first.token_id], params)


def continuation_body(body: dict[str, Any], first: FirstToken, done_ids: Sequence[int],
                      params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The rest of the answer after ``done_ids``, the answer's first tokens (P's first).

    They join the prompt: a backend continues from them as it would have after
    sampling them itself (with ``params``: loading the prompt's KV from P; without:
    computing it). A stream's token ids are always asked for (the module docstring
    says why).
    """
    num_done = len(done_ids)
    d_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    d_body["prompt"] = [*first.prompt_ids, *done_ids]
    d_body["max_tokens"] = body["max_tokens"] - num_done
    if body.get("stream") is True:
        d_body["return_token_ids"] = True
    if isinstance(body.get("min_tokens"), int):
        d_body["min_tokens"] = max(0, body["min_tokens"] - num_done)
    if params is not None:
        d_body["kv_transfer_params"] = params
    return d_body


def release_body(body: dict[str, Any], first: FirstToken, params: dict[str, Any]
                 ) -> dict[str, Any]:
    """A one-token D request whose only purpose is that P's held blocks are read and let go."""
    return {"model": body.get("model"), "prompt": [*first.prompt_ids, first.token_id],
            "max_tokens": 1, "temperature": 0.0, "kv_transfer_params": params}


def _fix_choice(choice: dict[str, Any], first: FirstToken, wants_ids: bool) -> None:
    choice["text"] = first.text + str(choice.get("text") or "")
    if isinstance(choice.get("token_ids"), list):  # D gave its tokens: P's comes first
        choice["token_ids"] = [first.token_id, *choice["token_ids"]]
    if isinstance(choice.get("prompt_token_ids"), list):
        choice["prompt_token_ids"] = first.prompt_ids if wants_ids else None


def fix_usage(usage: Any, num_moved: int) -> None:
    """Count ``num_moved`` tokens of a backend's prompt as output (the client's prompt
    did not have them); ``usage`` is changed in place (anything but a usage: ignored)."""
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        usage["prompt_tokens"] -= num_moved
        usage["completion_tokens"] = int(usage.get("completion_tokens") or 0) + num_moved


def merge_answer(body: dict[str, Any], first: FirstToken, d_answer: dict[str, Any]
                 ) -> dict[str, Any]:
    """The client's whole (non-streamed) answer: P's token, then D's."""
    merged = dict(d_answer)
    wants_ids = bool(body.get("return_token_ids"))
    choices = [dict(c) for c in merged.get("choices") or [] if isinstance(c, dict)]
    for choice in choices[:1]:
        _fix_choice(choice, first, wants_ids)
    merged["choices"] = choices
    if isinstance(merged.get("usage"), dict):
        merged["usage"] = dict(merged["usage"])
        fix_usage(merged["usage"], 1)
    return merged


def only_first(body: dict[str, Any], first: FirstToken) -> dict[str, Any]:
    """The client's answer when P's token ended the request (P's answer, for the client)."""
    answer = {k: v for k, v in first.answer.items() if k != "kv_transfer_params"}
    choice = dict(answer["choices"][0])
    if not body.get("return_token_ids"):
        choice["prompt_token_ids"] = None
    answer["choices"] = [choice]
    return answer


def first_event(body: dict[str, Any], first: FirstToken) -> dict[str, Any]:
    """The stream's first event: P's token (finished if it ended the request)."""
    wants_ids = bool(body.get("return_token_ids"))
    choice: dict[str, Any] = {
        "index": 0, "text": first.text, "logprobs": None,
        "finish_reason": "stop" if first.finished else None,
        "stop_reason": first.answer["choices"][0].get("stop_reason") if first.finished else None,
    }
    choice["token_ids"] = [first.token_id]
    if wants_ids:
        choice["prompt_token_ids"] = first.prompt_ids
    event = {key: first.answer.get(key) for key in ("id", "created", "model")}
    event.update(object="text_completion", choices=[choice])
    return event
