"""Tests for kvbridge.reference.engine.workers: TP worker processes, extensions, cleanup.

Each ``WorkerGroup`` here spawns real processes joined by gloo; groups are shared
where possible because every spawn re-imports torch.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.errors import ConfigError
from kvbridge.reference.engine.model_config import ModelConfig
from kvbridge.reference.engine.runner import InvalidStepError, ModelRunner, RequestStep, StepBatch
from kvbridge.reference.engine.worker_ipc import (
    CallExtension,
    Done,
    Failed,
    UnknownMethodError,
    WorkerError,
    WorkerGroupConfig,
    WorkerProtocolError,
)
from kvbridge.reference.engine.workers import WorkerGroup, _ProcessRank
from kvbridge.topology import KVLayout
from tests.reference.engine.helpers import MQA, PROMPTS, TINY, generate
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

PROBE = "tests.reference.engine.worker_ext:make_probe"
NUM_NEW = 6
REPO = Path(__file__).resolve().parents[2]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float) -> None:
    """Until none of ``pids`` runs (fails the test after ``timeout_s``)."""
    wait_until(lambda: [p for p in pids if pid_alive(p)], timeout_s, interval_s=0.1,
               until=lambda alive: not alive, message=f"processes {pids} to exit",
               describe=lambda alive: f"still running: {alive}")


def single_rank_tokens(config: ModelConfig, rows: list[list[int]]) -> list[list[int]]:
    runner = ModelRunner(config, 0, 1, None, 48, 16, KVLayout.NHD)
    return [generate(runner, p, r, NUM_NEW) for p, r in zip(PROMPTS, rows, strict=True)]


def rows_for(block_size: int) -> list[list[int]]:
    """Disjoint block rows, one per prompt, with room for the generated tokens."""
    rows, next_id = [], 0
    for prompt in PROMPTS:
        n = -(-(len(prompt) + NUM_NEW) // block_size)
        rows.append(list(range(next_id, next_id + n))[::-1])
        next_id += n
    return rows


@pytest.fixture(scope="module")
def tp2() -> Iterator[WorkerGroup]:
    config = WorkerGroupConfig(
        TINY,
        tp_size=2,
        num_blocks=48,
        block_size=16,
        layout=KVLayout.HND,
        worker_extension=PROBE,
        extension_config={"engine_id": "p0"},
        step_timeout_s=60,
    )
    with WorkerGroup(config) as group:
        yield group
        pids = [i.pid for i in group.info()]
    assert group.is_closed
    wait_gone(pids, timeout_s=1.0)
    group.shutdown()  # idempotent


def test_tp2_generates_the_tp1_tokens(tp2: WorkerGroup) -> None:
    rows = rows_for(16)
    expected = single_rank_tokens(TINY, rows)
    got = [generate(tp2, p, r, NUM_NEW, chunk=16) for p, r in zip(PROMPTS, rows, strict=True)]
    assert got == expected
    # Two requests decoding in one step come back in batch order.
    ends = [len(p) + NUM_NEW - 1 for p in PROMPTS[:2]]
    step = StepBatch([RequestStep(f"r{i}", [expected[i][-1]], ends[i], rows[i]) for i in range(2)])
    single = ModelRunner(TINY, 0, 1, None, 48, 16, KVLayout.NHD)
    for p, r in zip(PROMPTS[:2], rows[:2], strict=True):
        generate(single, p, r, NUM_NEW)
    assert tp2.execute(step) == single.execute(step)


def test_info_and_extension_see_each_ranks_cache(tp2: WorkerGroup) -> None:
    infos = tp2.info()
    assert [i.tp_rank for i in infos] == [0, 1]
    assert [i.kv_heads for i in infos] == [(0, 4), (4, 8)]
    assert infos[0].kv_cache_shape == (2, 48, 4, 16, TINY.head_dim)  # HND, 4 local heads
    assert len({i.pid for i in infos}) == 2 and os.getpid() not in {i.pid for i in infos}
    assert all(i.extension_methods == ("block_checksum", "describe", "fail", "fill_block")
               for i in infos)
    described = tp2.call("describe")
    assert [d["rank"] for d in described] == [0, 1]
    assert all(d["config"] == {"engine_id": "p0"} for d in described)
    assert all(d["num_layers"] == TINY.num_layers for d in described)
    tp2.call("fill_block", 47, 0.0)
    assert tp2.call("block_checksum", 47) == [0.0, 0.0]
    tp2.execute(StepBatch([RequestStep("x", [1, 2, 3], 0, [47], sample=False)]))
    assert all(s > 0 for s in tp2.call("block_checksum", 47))


def test_errors_in_calls_propagate_and_the_group_survives(tp2: WorkerGroup) -> None:
    with pytest.raises(WorkerError, match="boom") as info:
        tp2.call("fail", "boom")
    assert "rank 0" in str(info.value) and "rank 1" in str(info.value)
    with pytest.raises(UnknownMethodError, match="no public method 'no_such_method'"):
        tp2.call("no_such_method")
    # Only the class's public callables: no private names, no attributes.
    for name in ("__class__", "_private", "ctx"):
        with pytest.raises(UnknownMethodError, match=f"no public method '{name}'"):
            tp2.call(name)
    with pytest.raises(InvalidStepError, match="cache has 48 blocks"):
        tp2.execute(StepBatch([RequestStep("x", [1], 0, [48])]))
    assert [d["rank"] for d in tp2.call("describe")] == [0, 1]


def test_workers_answer_malformed_requests_and_stay_in_step(tp2: WorkerGroup) -> None:
    ranks = tp2._procs
    for rank in ranks:
        rank.conn.send(("call", "describe", (), {}))  # a tuple, not a worker_ipc request
    for rank in ranks:
        reply = rank.recv(30.0)
        assert isinstance(reply, Failed)
        assert "not a well-formed worker request: tuple" in reply.traceback
    for rank in ranks:
        rank.conn.send_bytes(b"not a pickle")
    for rank in ranks:
        reply = rank.recv(30.0)
        assert isinstance(reply, Failed) and "undecodable request" in reply.traceback
    assert [d["rank"] for d in tp2.call("describe")] == [0, 1]


def test_a_reply_that_is_not_a_reply_is_a_protocol_error() -> None:
    parent_end, worker_end = multiprocessing.Pipe()
    rank = _ProcessRank(multiprocessing.current_process(), parent_end, tp_rank=0)
    worker_end.send(Done([7]))
    assert rank.recv(5.0) == Done([7])
    worker_end.send(("ok", [7]))
    with pytest.raises(WorkerProtocolError, match="sent tuple, not Done or Failed"):
        rank.recv(5.0)
    worker_end.send(Failed(traceback=None))  # type: ignore[arg-type]
    with pytest.raises(WorkerProtocolError, match="sent Failed"):
        rank.recv(5.0)
    worker_end.send_bytes(b"not a pickle")
    with pytest.raises(WorkerProtocolError, match="undecodable reply"):
        rank.recv(5.0)
    parent_end.close()
    worker_end.close()


def test_replicated_kv_heads_then_a_rank_dies() -> None:
    # One KV head, two ranks: both hold head 0 (as kvbridge.topology says).
    rows = rows_for(16)
    expected = single_rank_tokens(MQA, rows)
    group = WorkerGroup(WorkerGroupConfig(MQA, tp_size=2, num_blocks=48, block_size=16))
    try:
        assert [i.kv_heads for i in group.info()] == [(0, 1), (0, 1)]
        assert [i.extension_methods for i in group.info()] == [(), ()]
        with pytest.raises(WorkerError, match="no worker extension configured"):
            group.call("describe")
        got = [generate(group, p, r, NUM_NEW) for p, r in zip(PROMPTS, rows, strict=True)]
        assert got == expected
        pids = [i.pid for i in group.info()]
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError):
            generate(group, PROMPTS[0], rows[0], 2)
        assert group.is_closed  # the survivor was stopped too
        wait_gone(pids, timeout_s=1.0)
        with pytest.raises(WorkerError, match="shut down"):
            group.execute(StepBatch([]))
    finally:
        group.shutdown()


def test_failed_startup_stops_every_worker() -> None:
    config = WorkerGroupConfig(
        TINY,
        tp_size=1,
        num_blocks=4,
        block_size=16,
        worker_extension="tests.reference.engine.worker_ext:broken_factory",
    )
    before = {c.pid for c in multiprocessing.active_children()}
    with pytest.raises(WorkerError, match="extension refused to start on rank 0"):
        WorkerGroup(config)
    assert {c.pid for c in multiprocessing.active_children()} <= before


def test_in_process_group() -> None:
    config = WorkerGroupConfig(
        TINY, tp_size=1, num_blocks=16, block_size=16, worker_extension=PROBE, in_process=True
    )
    with WorkerGroup(config) as group:
        assert group.local_runner is not None
        assert group.info()[0].pid == os.getpid()
        tokens = generate(group, PROMPTS[0], [3], 2)
        assert tokens == generate(ModelRunner(TINY, 0, 1, None, 16, 16, "NHD"), PROMPTS[0], [3], 2)
        assert group.call("describe")[0]["rank"] == 0
        with pytest.raises(UnknownMethodError, match="no public method 'no_such_method'"):
            group.call("no_such_method")
        # The rank checks the name too (for requests that skip the group's check).
        assert group._local is not None
        reply = group._local.worker.reply(CallExtension("__init__"))
        assert isinstance(reply, Failed)
        assert "UnknownMethodError: call('__init__')" in reply.traceback
    with pytest.raises(ConfigError, match="in_process"):
        WorkerGroupConfig(TINY, tp_size=2, num_blocks=4, block_size=16, in_process=True)


def test_workers_exit_when_the_engine_process_dies() -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from kvbridge.reference.engine.model_config import get_model_config
        from kvbridge.reference.engine.worker_ipc import WorkerGroupConfig
        from kvbridge.reference.engine.workers import WorkerGroup

        if __name__ == "__main__":
            cfg = WorkerGroupConfig(get_model_config("tiny"), tp_size=1, num_blocks=4,
                                    block_size=16)
            group = WorkerGroup(cfg)
            print(group.info()[0].pid, flush=True)
            time.sleep(300)
        """
    )
    engine = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert engine.stdout is not None
        worker_pid = int(engine.stdout.readline())
        assert pid_alive(worker_pid)
        engine.send_signal(signal.SIGKILL)  # no cleanup code runs in the engine
        engine.wait(10)
        wait_gone([worker_pid], timeout_s=15.0)
    finally:
        engine.kill()
        engine.wait(10)
