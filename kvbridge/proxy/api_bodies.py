"""The client bodies the P/D proxy accepts: checks before any backend call, and the split
of a request for several choices into requests for one.

``kvbridge/proxy/app.py`` parses every ``POST`` with :func:`parse` and routes the
units :func:`split` gives it. Why the proxy checks what the backends would check
anyway: P is always asked for one token, not streamed, so it does not notice a
bad ``stream``, ``max_tokens`` or ``max_completion_tokens``; D would, after P
has prefilled and holds the prompt's blocks for it.

Why several choices are split: vLLM answers ``n`` choices (or several prompts of a
completion) from one request as that many engine requests, and a P asked so
prefills each, holds each one's blocks under a grant of its own, but returns the
``kv_transfer_params`` of one only; the others would be held for nobody until
their lease ends, and a D handed one set of params for ``n`` requests reads the
prompt once at best. So the proxy asks for each choice on its own, P then D, as
vLLM's engine does inside (choice ``j`` of a prompt with ``seed + j``, as
vLLM's child requests get), and merges the answers (``fan_out.py``)::

    {"prompt": [a, b], "n": 2, "seed": 7}
        -> index 0: {"prompt": a, "seed": 7}   index 1: {"prompt": a, "seed": 8}
           index 2: {"prompt": b, "seed": 7}   index 3: {"prompt": b, "seed": 8}

Pure functions; imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvbridge.http_common import ApiError

__all__ = ["CHAT", "COMPLETIONS", "Api", "classic_release_body", "parse", "split"]


@dataclass(frozen=True, slots=True)
class Api:
    """One OpenAI-style endpoint the proxy routes P -> D.

    Attributes:
        path: Its path, the same on the proxy and on the backends.
        chat: Chat completions (``messages``), else completions (``prompt``).
    """

    path: str
    chat: bool


COMPLETIONS = Api("/v1/completions", chat=False)
CHAT = Api("/v1/chat/completions", chat=True)

#: vLLM takes a temperature below this for greedy sampling (``sampling_params._SAMPLING_EPS``).
_GREEDY_BELOW = 1e-5

#: What D needs besides the messages to render the prompt P rendered (chat).
_RENDER_KEYS = ("model", "messages", "add_generation_prompt", "continue_final_message",
                "add_special_tokens", "chat_template", "chat_template_kwargs", "tools",
                "documents", "mm_processor_kwargs")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse(raw: bytes, api: Api, max_choices: int) -> dict[str, Any]:
    """The client's body, checked where a backend would notice a mistake too late.

    Args:
        raw: The request body.
        api: The endpoint it was sent to.
        max_choices: Most choices (``n`` times the prompts) one request may ask for.

    Returns:
        The body as a JSON object.

    Raises:
        ApiError: 400 naming the field, its value and what is accepted.
    """
    try:
        # NaN and Infinity are not JSON: refused here, they could not be forwarded.
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ApiError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    if not isinstance(body.get("stream", False), bool):
        raise ApiError(400, f"stream must be true or false, got {body['stream']!r:.40}")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and not (_is_int(value) and value >= 1):
            raise ApiError(400, f"{key} must be an integer >= 1, got {value!r:.40}")
    _check_choices(body, api, max_choices)
    if api.chat and not (isinstance(body.get("messages"), list) and body["messages"]):
        raise ApiError(400, f"messages must be a non-empty list of messages, got "
                            f"{body.get('messages')!r:.40}")
    return body


def _check_choices(body: dict[str, Any], api: Api, max_choices: int) -> None:
    n = body.get("n")
    if n is not None and not (_is_int(n) and n >= 1):
        raise ApiError(400, f"n must be an integer >= 1, got {n!r:.40}")
    n = n or 1
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise ApiError(400, f"best_of {best_of!r:.40} is not supported by kvbridge proxy (nor "
                            f"by vLLM's V1 engine, which ignores it): leave it out, or set it "
                            f"to n ({n})")
    if body.get("use_beam_search"):
        raise ApiError(400, "use_beam_search is not supported by kvbridge proxy: beam search "
                            "extends its beams one engine call at a time, which P/D cannot "
                            "split; send it to a colocated server")
    temperature = body.get("temperature")
    if n > 1 and isinstance(temperature, int | float) and temperature < _GREEDY_BELOW:
        # vLLM's own refusal: its n choices of a greedy request would all be the same
        raise ApiError(400, f"n must be 1 when using greedy sampling, got {n}.")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise ApiError(400, f"seed must be an integer, got {seed!r:.40}")
    embeds = body.get("prompt_embeds")
    if not api.chat and isinstance(embeds, list) and len(embeds) > 1:
        raise ApiError(400, f"{len(embeds)} prompt_embeds in one request: kvbridge proxy "
                            f"takes one, send one request per prompt")
    num_choices = n * len(_prompts(body, api))
    if num_choices > max_choices:
        raise ApiError(400, f"{num_choices} choices asked for (n={n} times "
                            f"{num_choices // n} prompts); kvbridge proxy serves at most "
                            f"{max_choices} per request")
    options = body.get("stream_options")
    if num_choices > 1 and isinstance(options, dict) and options.get("continuous_usage_stats"):
        raise ApiError(400, "stream_options.continuous_usage_stats with several choices is "
                            "not supported by kvbridge proxy (each choice is served on its "
                            "own); ask for include_usage instead")


def _prompts(body: dict[str, Any], api: Api) -> list[Any]:
    """The prompts of a request: a completion's list of texts or of token lists, else one."""
    prompt = body.get("prompt")
    if (not api.chat and isinstance(prompt, list) and prompt
            and all(isinstance(p, str | list) for p in prompt)):
        return list(prompt)
    return [prompt]


def split(body: dict[str, Any], api: Api) -> list[dict[str, Any]]:
    """One body per choice, in the order of the answer's choice ``index`` (module docstring).

    A request for one choice is returned as it is.
    """
    n = body.get("n") or 1
    prompts = _prompts(body, api)
    if n == 1 and len(prompts) == 1:
        return [body]
    base = {k: v for k, v in body.items() if k not in ("n", "best_of")}
    seed = body.get("seed")
    units = []
    for prompt in prompts:
        for j in range(n):
            unit = dict(base)
            if not api.chat:
                unit["prompt"] = prompt
            if seed is not None:
                unit["seed"] = seed + j
            units.append(unit)
    return units


def classic_release_body(body: dict[str, Any], api: Api, params: dict[str, Any]
                         ) -> dict[str, Any]:
    """A one-token D request of the client's prompt whose only purpose is that P's held
    blocks are read and let go (the client's own request did not reach D).

    Only what renders the prompt is kept: D refused the client's own request,
    maybe for a field P did not look at.
    """
    keep = _RENDER_KEYS if api.chat else ("model", "prompt")
    release = {k: body[k] for k in keep if k in body}
    release.update(max_tokens=1, temperature=0.0, kv_transfer_params=params)
    return release
