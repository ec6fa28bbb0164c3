"""Hostile input and dead peers, in real SGLang P/D servers with the kvbridge backend.

Runs after ``test_pd.py`` on the same servers; its last test kills ``p2``.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request

from tests.integrations.sglang.servers import PYTHON, PdClient, Server, SglangSet, post_json
from tests.integrations.sglang.test_pd import _generate_body, _reference, _token_ids

#: Frames a stranger sends to P's control socket: SGLang's own message kinds, garbage,
#: and kvbridge frames with a MAC made without the secret.
_SEND_GARBAGE = r"""
import sys, zmq, msgspec
from kvbridge.integrations.sglang.messages import Abort, MessageCodec, Wanted
ctx = zmq.Context()
sock = ctx.socket(zmq.PUSH)
sock.connect(f"tcp://{sys.argv[1]}:{sys.argv[2]}")
forged = MessageCodec(b"not the secret, but long enough to look like one")
frames = [
    [b"garbage"], [b"KVBRIDGE"], [b"KVBRIDGE", b"\xc1\xc1", b""], [b"None", b"x" * 1000],
    forged.encode(Wanted(room=1, engine_id="evil", endpoint="127.0.0.1", port=9, tp_rank=0,
                         num_pages=1, num_wanted=1, decode_prefix_len=0, is_dummy=False)),
    forged.encode(Abort(room=int(sys.argv[3]), endpoint="127.0.0.1", port=9)),
    [b"KVBRIDGE", msgspec.msgpack.encode({"kind": "wanted", "room": -1}), b"x" * 32],
]
for parts in frames:
    sock.send_multipart(parts)
sock.close(linger=2000)
"""


def _rank_address(prefill: Server, tp_rank: int = 0) -> tuple[str, int]:
    url = (f"http://127.0.0.1:{prefill.bootstrap_port}/route?prefill_dp_rank=0"
           f"&prefill_cp_rank=0&target_tp_rank={tp_rank}&target_pp_rank=0")
    with urllib.request.urlopen(url, timeout=10) as response:
        info = json.loads(response.read())
    return info["rank_ip"], int(info["rank_port"])


def test_forged_control_messages_are_dropped(sglang_set: SglangSet) -> None:
    """A stranger's frames on P's control socket (no secret) change nothing: P logs and
    drops them, and the next request is still the single server's."""
    ip, port = _rank_address(sglang_set.p1)
    subprocess.run([str(PYTHON), "-c", _SEND_GARBAGE, ip, str(port), "12345"], check=True,
                   timeout=60, env={"PATH": "/usr/bin:/bin"})
    prompt = "after the garbage, " * 4
    got = _token_ids(*PdClient(sglang_set.p1, sglang_set.d).generate(_generate_body(prompt)))
    assert got == _reference(sglang_set, prompt)
    log = sglang_set.p1.log.read_text(errors="replace")
    assert "MAC does not verify" in log
    assert "not kvbridge's" in log
    assert sglang_set.p1.alive()


def test_bootstrap_refuses_strangers(sglang_set: SglangSet) -> None:
    """SGLang's bootstrap registry tells D where P's ranks listen: a registration
    without the MAC of P's ranks (a stranger listing a rank of its own) is refused,
    and the registry keeps answering for the real ranks."""
    url = f"http://127.0.0.1:{sglang_set.p1.bootstrap_port}/route"
    before = _rank_address(sglang_set.p1)
    row = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
           "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
           "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "10.6.6.6",
           "rank_port": 6666, "page_size": 1, "kv_cache_dtype": "auto"}
    for body, headers in ((json.dumps(row).encode(), {}),
                          (json.dumps(row).encode(), {"X-Kvbridge-Mac": "00" * 32}),
                          (b"{not json", {"X-Kvbridge-Mac": "zz"})):
        request = urllib.request.Request(url, body, {"content-type": "application/json",
                                                     **headers}, method="PUT")
        try:
            urllib.request.urlopen(request, timeout=10)
            raise AssertionError("an unauthenticated registration was accepted")
        except urllib.error.HTTPError as exc:
            assert exc.code == 403, exc.read()
    assert _rank_address(sglang_set.p1) == before
    prompt = "after the stranger, " * 3
    got = _token_ids(*PdClient(sglang_set.p1, sglang_set.d).generate(_generate_body(prompt)))
    assert got == _reference(sglang_set, prompt)


def test_decode_fails_fast_when_prefill_dies(sglang_set: SglangSet) -> None:
    """D waits for P's KV (P never got the request), P is killed: D answers an error
    within its heartbeat deadline (~10 s), not SGLang's 300 s transfer timeout."""
    client = PdClient(sglang_set.p2, sglang_set.d)
    results: list[tuple[int, object]] = []
    import threading

    waiter = threading.Thread(target=lambda: results.append(client.generate(
        _generate_body("nobody prefills this " * 3), timeout_s=120, send_to_prefill=False)))
    waiter.start()
    time.sleep(3.0)  # D has asked P for the room by now (it cannot finish without P)
    assert waiter.is_alive(), results
    started = time.monotonic()
    sglang_set.p2.kill()
    waiter.join(100)
    assert not waiter.is_alive(), "D still waits for a dead P"
    status, answer = results[0]
    assert status != 200, answer
    assert "prefill" in json.dumps(answer).lower(), answer
    assert time.monotonic() - started < 90  # far below SGLang's 300 s transfer timeout
    # D keeps serving the P that is alive.
    prompt = "still serving " * 3
    got = _token_ids(*PdClient(sglang_set.p1, sglang_set.d).generate(_generate_body(prompt)))
    assert got == _reference(sglang_set, prompt)
    assert post_json(sglang_set.router.url + "/generate", _generate_body(prompt))[0] == 200
