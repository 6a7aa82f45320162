"""A node other than node 0 of a multi-node deployment (`--node-rank 1..`): it serves no HTTP
and schedules nothing; it starts the device workers of its tensor-parallel ranks, which join
node 0's group and run the plans node 0's rank 0 hands them, and ends when they do.

Exit codes: 0 once node 0 shut the group down, 2 when a rank could not reach the master
(one line says which), 1 when a rank failed later. SIGINT/SIGTERM stop the ranks at once:
node 0's replica then ends its in-flight requests with `error`.
"""

from __future__ import annotations

import signal
import subprocess
import time

import structlog

from pypto_serving.actors.device_client import start_rank
from pypto_serving.messages.worker import LogConfig, ParallelConfig

log = structlog.get_logger()
JOIN_FAILED = 3  # a rank's exit code when it could not join its group (worker/main.py)
POLL_S = 0.2


def run_node(parallel: ParallelConfig, log_config: LogConfig, model_path: str) -> tuple[int, str]:
    """(exit code, the error line, "" for none)."""
    ranks = {r: start_rank(r, parallel, log_config, model_path) for r in parallel.local_ranks}
    log.info(f"Node {parallel.node_rank} of {parallel.nnodes}: tensor-parallel ranks "
             f"{list(ranks)} on devices {parallel.devices}, joining "
             f"{parallel.master_addr}:{parallel.master_port}", pids=[p.pid for p in ranks.values()])
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    try:
        while not stopping and all(p.poll() is None for p in ranks.values()):
            time.sleep(POLL_S)
    finally:
        _stop(ranks.values(), at_once=bool(stopping))
    if stopping:
        return 0, ""
    failed = {r: p.returncode for r, p in ranks.items() if p.returncode}
    if any(code == JOIN_FAILED for code in failed.values()):
        return 2, (f"node {parallel.node_rank} could not join the group at {parallel.master_addr}:"
                   f"{parallel.master_port} within {parallel.timeout_s:g} s (is node 0 started with "
                   "the same --master-addr/--master-port?)")
    if failed:
        return 1, f"tensor-parallel rank(s) {sorted(failed)} of node {parallel.node_rank} failed"
    log.info(f"Node {parallel.node_rank}: the group was shut down")
    return 0, ""


def _stop(ranks: object, at_once: bool, timeout: float = 10.0) -> None:
    """The ranks end by themselves once one of them is gone (their collectives fail); what is
    left after `timeout` (or at once, on a signal) is killed."""
    deadline = time.monotonic() + (0 if at_once else timeout)
    for p in ranks:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
