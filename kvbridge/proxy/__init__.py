"""The P/D proxy: an OpenAI-style front that prefills on P and decodes on D.

What vLLM users run in front of their P and D servers (beside vllm-router),
and what ``kvbridge demo`` runs in front of the reference engine. It knows
nothing of kvbridge's connector: it passes ``kv_transfer_params`` along.
Imports only ``kvbridge.errors`` and ``kvbridge.http_common``.

Map::

    config.py        ProxyConfig: backends and limits; backend_urls
    app.py           PDProxy and build_proxy_app: routes, the classic flow, /health
    api_bodies.py    parsing bodies; a request for several choices split in units
    fan_out.py       merging the units' answers
    backend_pool.py  round robin, unhealthy backends, failover
    first_token.py   the first-token flow (P's token to the client at once)
    continuation.py  where a continuation resumes, and checks on its legs
    recovery.py      a D failing after P's token: the rest asked for again
    metrics.py       ProxyMetrics (GET /metrics)

``kvbridge proxy`` (``kvbridge/cli/proxy.py``) serves ``app.py``'s :func:`build_proxy_app`
with uvicorn: ``POST /v1/completions`` and ``POST /v1/chat/completions`` go P
then D, ``GET /v1/models`` is D's answer, ``GET /health`` reports every backend,
``GET /metrics`` the proxy's counters.
Per request, with round robin over each pool::

    client --body--> proxy --body + max_tokens=1, stream=false,
                              kv_transfer_params={"do_remote_decode": true}--> P
                     proxy <--{..., "kv_transfer_params": {...}}-------------- P
                     proxy --body + P's kv_transfer_params-------------------> D
    client <--D's answer (SSE passed through as it arrives, or one JSON)---- D

That is the classic flow. By default (``config.ProxyConfig.first_token``) completions
that allow it take the first-token path (``first_token.py``): the
client gets P's token the moment P answers, and D, asked for the rest with
that token appended to its prompt, loads the prompt's KV and continues; so
the client's first token waits for P only. Chat completions take the classic
flow: D would continue after P's token only from token ids, which only
``/v1/completions`` takes, and a chat answer passes through what the server
does to chat output alone (reasoning and tool-call parsers, set by server
flags the proxy cannot see), so the answer could differ.

A request for several choices (``n``, or a completion's list of prompts) is
split into one request per choice (``api_bodies.py``: P would hold a grant
per choice and hand out the params of one) and the answers merged
(``fan_out.py``).

P answering without ``kv_transfer_params`` (no connector) is not an error: D
then prefills locally. A 4xx from a backend (the client's mistake) is passed
through; in the classic flow, a backend that fails, answers 5xx or exceeds its
time limit gives the client a 502 with the reason (or, mid-stream, an SSE
error event). In the first-token flow, a D failing after P's token has the
rest of the answer asked for again, from where the client's tokens end, from
another D (or the same) that computes the prompt, then from a P
(``recovery.py``); the client gets an error only when none can finish, and
``GET /metrics`` counts both. Every backend call has a time limit. When P has
prefilled but D never gets the request carrying P's params (D refused it, or
the client left after P's first token and before D was asked), the proxy asks
D in the background for one token with them, so that P's blocks are read and
let go at once rather than held for nobody until their lease ends.

Unhealthy backends (``backend_pool.py``): one that could not be reached, did
not answer in time or answered 502, 503 or 504 is skipped for
``unhealthy_backoff_s`` while another of its role is usable, and probed on
``/health`` before it gets requests again; a 500 fails its request only. A
prefill whose connection failed is retried once on another P (the client has
received nothing yet); a classic decode only when its connection never opened
(D cannot have used P's blocks). A classic stream to the client is never
retried. With no usable backend of a role the client gets 503 and, per
backend, why. ``GET /health`` reports every backend's health.

Imports no torch: the proxy starts in a fraction of a second.
"""
