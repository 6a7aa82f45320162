"""benchmarks/spy_summary.py: py-spy's raw stacks as busy shares, idle waits left out."""

from __future__ import annotations

from pathlib import Path

from benchmarks.spy_summary import summarize


def test_busy_shares_leave_out_the_loop_waiting_and_count_a_recursive_frame_once(tmp_path: Path):
    raw = tmp_path / "api.txt"
    raw.write_text(
        "run (asyncio/base_events.py:607);EpollSelector.select (selectors.py:468) 50\n"
        "run (asyncio/base_events.py:607);step (/x/y/pypto_serving/core/scheduler.py:151) 30\n"
        "run (asyncio/base_events.py:607);f (a.py:1);f (a.py:1);"
        "write (/u/lib/python3.11/asyncio/x.py:9) 10\n")
    busy, inclusive, own = summarize(raw)
    assert busy == 40
    assert inclusive["run (asyncio/base_events.py:607)"] == 40
    assert inclusive["f (a.py:1)"] == 10  # twice on one stack, counted once
    assert own == {"step (pypto_serving/core/scheduler.py:151)": 30, "write (asyncio/x.py:9)": 10}
