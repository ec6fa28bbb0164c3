"""``kvbridge.reference.engine.wakeup``: set, clear and wait, across threads and processes."""

from __future__ import annotations

import multiprocessing as mp
import threading

from kvbridge.reference.engine.wakeup import Wakeup, WakeupSender


def test_set_clear_wait() -> None:
    flag = Wakeup()
    try:
        assert not flag.wait(0.0)
        flag.set()
        flag.set()
        assert flag.wait(0.0) and flag.wait(0.0)  # waiting consumes nothing
        flag.clear()
        assert not flag.wait(0.0)
    finally:
        flag.close()


def test_many_sets_never_block() -> None:
    flag = Wakeup()
    try:
        for _ in range(200_000):  # far more than a pipe holds
            flag.set()
        assert flag.wait(0.0)
        flag.clear()
        assert not flag.wait(0.0)
    finally:
        flag.close()


def test_a_thread_wakes_the_waiter() -> None:
    flag = Wakeup()
    sender = flag.sender()
    try:
        timer = threading.Timer(0.05, sender)
        timer.start()
        assert flag.wait(10.0)
        timer.join()
    finally:
        sender.close()
        flag.close()


def _poke(sender: WakeupSender) -> None:
    sender()


def test_a_spawned_process_wakes_the_waiter() -> None:
    flag = Wakeup()
    try:
        child = mp.get_context("spawn").Process(target=_poke, args=(flag.sender(),))
        child.start()
        assert flag.wait(30.0)
        child.join(30.0)
        assert child.exitcode == 0
    finally:
        flag.close()


def test_closed_flag_ignores_sets_and_does_not_block() -> None:
    flag = Wakeup()
    sender = flag.sender()
    flag.close()
    flag.set()
    sender()  # the read end is gone: EPIPE is swallowed
    flag.clear()
    assert flag.wait(5.0)  # at once: nothing can set a closed flag
    flag.close()
    sender.close()
