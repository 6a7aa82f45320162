"""The device worker's pipe loop (`worker/main.py`): with async scheduling the next plan is
written while a step runs, so the worker reads its pipe on a thread of its own. A parent
writing a big plan while the worker writes a big result must not deadlock."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
from multiprocess.connection import Connection

from pypto_serving.messages.worker import ScheduledSeq, Shutdown, StepPlan, StepResult, TopLogprob
from pypto_serving.telemetry.profiling import WorkerProfiler
from pypto_serving.worker.main import _serve

BIG = 400_000  # tokens: a plan and a result each well over a socket's buffer


class SlowRunner:
    """Takes a while per step and answers with a result bigger than the pipe holds."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def execute(self, plan: StepPlan) -> StepResult:
        time.sleep(0.2)
        self.steps.append(plan.step_id)
        return StepResult(plan.step_id, [1], [2], [0.0], [[TopLogprob(3, -1.0)] * BIG])

    def idle(self) -> None:
        pass


def test_a_big_plan_sent_during_a_step_with_a_big_result_does_not_deadlock():
    parent_sock, worker_sock = socket.socketpair()
    parent, worker = Connection(parent_sock.detach()), Connection(worker_sock.detach())
    runner = SlowRunner()
    encoder = msgspec.msgpack.Encoder()
    serving = threading.Thread(target=_serve, args=(worker, runner, encoder, WorkerProfiler("w", [])),
                               daemon=True)
    serving.start()
    plans = [StepPlan(i, [ScheduledSeq(1, [5] * BIG, 0, [], True)]) for i in (1, 2)]
    sent = threading.Event()

    def send_both() -> None:  # the second goes out while the worker runs (and answers) the first
        for plan in plans:
            parent.send_bytes(encoder.encode(plan))
        sent.set()

    threading.Thread(target=send_both, daemon=True).start()
    assert sent.wait(10), "the parent stayed blocked writing the second plan"
    decoder = msgspec.msgpack.Decoder(StepResult)
    got = [decoder.decode(parent.recv_bytes()).step_id for _ in plans]
    assert got == [1, 2] and runner.steps == [1, 2]
    parent.send_bytes(encoder.encode(Shutdown()))
    serving.join(10)
    assert not serving.is_alive()
