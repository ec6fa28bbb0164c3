"""The per-chunk trace of staged reads (``transfer/chunk_trace.py``; issue #41 item 3).

One JSON line per staged chunk per side, stamps in phase order; nothing unless
``KVBRIDGE_TRACE_CHUNKS`` named a directory when the agent was constructed; a
write that fails turns the trace off without failing anything. The reads are
real: both halves in this process (``tests/transfer/inproc.py``), then two
``TransferAgent``s in this process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from kvbridge.transfer.agent import TransferAgent
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.chunk_trace import ENV, ChunkTrace, ReadChunk, ServedChunk, line_of
from tests.transfer.inproc import (
    BLOCK_NBYTES,
    BLOCK_SIZE,
    COMPAT,
    LAYERS,
    TOPOLOGY,
    caches,
    same_blocks,
    server_and_reader,
)
from tests.waiting import wait_until, wait_until_async

PHASES = {"server": ["credit", "buffer", "packed", "sent"],
          "reader": ["posted", "arrived", "unpacked", "credited"]}
CHUNK_NBYTES = BLOCK_NBYTES * LAYERS  # one block a chunk


def lines(directory: Path) -> list[dict[str, Any]]:
    """Every line this process wrote into ``directory``."""
    path = directory / f"chunks-{os.getpid()}.jsonl"
    return [json.loads(text) for text in path.read_text().splitlines()]


def check_line(line: dict[str, Any], *, last_window: bool) -> dict[str, int]:
    """A well-formed line: its fields, and its stamps in phase order, never decreasing."""
    assert set(line) == {"side", "xfer_id", "chunk", "nbytes", "launch", "stamps_ns"}, line
    phases = PHASES[line["side"]]
    if line["side"] == "reader" and last_window:  # nothing left to credit
        phases = phases[:-1]
    stamps: dict[str, int] = line["stamps_ns"]
    assert list(stamps) == phases, line
    values = [stamps[phase] for phase in phases]
    assert all(isinstance(v, int) for v in values) and values == sorted(values), line
    return stamps


def test_the_trace_is_off_unless_the_variable_names_a_directory(tmp_path: Path) -> None:
    assert ChunkTrace.from_env({}) is None
    assert ChunkTrace.from_env({ENV: ""}) is None
    trace = ChunkTrace.from_env({ENV: str(tmp_path / "traces")})
    assert trace is not None and trace.path == tmp_path / "traces" / f"chunks-{os.getpid()}.jsonl"
    trace.close()
    assert not (tmp_path / "traces").exists()  # nothing to write: nothing made


def test_a_record_is_one_line_with_the_stamps_it_reached() -> None:
    served = ServedChunk(7, 2, 4096, "loop", credit=10, buffer=11, packed=15)
    assert line_of(served) == {"side": "server", "xfer_id": 7, "chunk": 2, "nbytes": 4096,
                               "launch": "loop",
                               "stamps_ns": {"credit": 10, "buffer": 11, "packed": 15}}
    read = ReadChunk(7, 2, 4096, "thread", posted=1, arrived=2, unpacked=3, credited=4)
    assert line_of(read)["stamps_ns"] == {"posted": 1, "arrived": 2, "unpacked": 3,
                                          "credited": 4}


def test_a_failed_write_turns_the_trace_off_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    trace = ChunkTrace(blocker)
    with caplog.at_level(logging.WARNING, logger="kvbridge.transfer.chunk_trace"):
        trace.write([ServedChunk(1, 0, 8, "thread", credit=1)])  # raises nothing
        trace.write([ServedChunk(1, 1, 8, "thread", credit=2)])
    assert trace.off
    logged = [r.getMessage() for r in caplog.records if r.name == "kvbridge.transfer.chunk_trace"]
    assert len(logged) == 1 and "chunk trace off" in logged[0], logged
    trace.close()


@pytest.mark.parametrize("mode", ["loop", "thread"])
def test_a_staged_read_writes_one_line_per_chunk_per_side(tmp_path: Path, mode: str) -> None:
    remote, local = [9, 2, 20, 7, 11, 3, 30], [1, 4, 8, 16, 5, 0, 12]
    window = 3
    trace = ChunkTrace(tmp_path)

    async def run() -> None:
        config = {"direct_reads": False, "staged_launch": mode}
        async with server_and_reader(config, {**config, "window_chunks": window},
                                     trace=trace) as (server, reader):
            server.ctx.grants.issue("r", remote, 1, grant=(tok := secrets.token_urlsafe(16)))
            reader.submit("r", tok, remote, local)
            assert (await reader.outcome("r")).ok
            assert same_blocks(server.ctx.local, remote, reader.ctx.local, local)
            await wait_until_async(lambda: server.ctx.num_reads_served == 1, 10.0,
                                   message="the server's read to end")  # its lines written

    asyncio.run(run())
    trace.close()
    found = lines(tmp_path)
    by_side = {side: sorted((line for line in found if line["side"] == side),
                            key=lambda line: line["chunk"]) for side in PHASES}
    assert len(found) == 2 * len(remote)
    for side, side_lines in by_side.items():
        assert [line["chunk"] for line in side_lines] == list(range(len(remote))), side
        assert {line["launch"] for line in side_lines} == {mode}
        assert {line["nbytes"] for line in side_lines} == {CHUNK_NBYTES}
    assert len({line["xfer_id"] for line in found}) == 1  # one read, both sides
    reader_stamps = [check_line(line, last_window=line["chunk"] >= len(remote) - window)
                     for line in by_side["reader"]]
    for line in by_side["server"]:
        check_line(line, last_window=False)
    # a buffer takes chunk c + window only once chunk c's unpack ended, and is
    # credited once posted
    for chunk in range(window, len(remote)):
        before, after = reader_stamps[chunk - window], reader_stamps[chunk]
        assert before["unpacked"] <= after["posted"] <= before["credited"]


def test_an_agent_traces_only_when_constructed_with_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader is constructed with the variable set, the server without: the
    file holds the reader's lines only. Closed, the agents have written them."""
    config = AgentConfig(direct_reads=False, local_copy=False, reply_timeout_s=5.0,
                         read_timeout_s=20.0, chunk_nbytes=2 * CHUNK_NBYTES)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    server = TransferAgent("p-trace", TOPOLOGY, 0, 0, COMPAT, config=config)
    monkeypatch.setenv(ENV, str(tmp_path / "traces"))
    reader = TransferAgent("d-trace", TOPOLOGY, 0, 0, COMPAT, config=config)
    monkeypatch.delenv(ENV)
    server.register_kv_caches(caches(3))
    reader.register_kv_caches(caches(None))
    server.start()
    reader.start()
    try:
        blocks = [3, 9, 4, 12, 7, 1]  # three chunks of two blocks
        grant = server.issue_grant("t", blocks, 1).grant
        reader.start_read("t", engine_id="p-trace", host="127.0.0.1", port=server.port,
                          remote_block_ids=blocks, local_block_ids=[0, 1, 2, 3, 4, 5],
                          grant=grant, num_tokens=BLOCK_SIZE * len(blocks))
        wait_until(lambda: "t" in reader.get_finished()[1], 20.0, message="the read")
        assert reader.get_failed_block_ids() == {}
    finally:
        reader.close()
        server.close()
    found = lines(tmp_path / "traces")
    assert [line["chunk"] for line in found] == [0, 1, 2]
    assert {line["side"] for line in found} == {"reader"}
    assert {line["launch"] for line in found} == {"thread"}  # "auto" on CPU caches
    for line in found:
        check_line(line, last_window=line["chunk"] >= 1)  # window_chunks 2
    assert [p.name for p in tmp_path.rglob("chunks-*")] == [f"chunks-{os.getpid()}.jsonl"]
