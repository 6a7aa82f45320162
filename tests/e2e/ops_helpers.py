"""Helpers of the e2e tests: background streams, metrics, processes, a tiny tokenizer."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers


class BackgroundStream(threading.Thread):
    """A streaming completion read on a thread; `first` is set once its first event arrived."""

    def __init__(self, url: str, body: dict[str, Any]):
        super().__init__(daemon=True)
        self.url = url
        self.body = {**body, "stream": True}
        self.first = threading.Event()
        self.events: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=600) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.first.set()
        except httpx.HTTPError as exc:  # a server that exits at once cuts the stream
            self.error = exc
        finally:
            self.first.set()

    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    @property
    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0]["finish_reason"] for c in self.chunks() if c.get("choices")]
        return next((r for r in reversed(reasons) if r), None)

    @property
    def usage(self) -> dict[str, Any]:
        assert self.events[-1] == "[DONE]", self.events[-3:]
        return self.chunks()[-1]["usage"]


def replica(url: str) -> dict[str, Any]:
    return httpx.get(url + "/metrics/json", timeout=30).json()["replicas"][0]


def wait_for(condition: Callable[[], bool], timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def idle(url: str, finished: int) -> bool:
    """At least `finished` requests ended, nothing runs or waits, every KV block is free."""
    r = replica(url)
    gauges = r["gauges"]
    return (r["counters"]["requests_finished"] >= finished and gauges["running"] == 0
            and gauges["waiting"] == 0 and gauges["kv_cache_usage"] == 0)


def children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def assert_all_gone(procs: list[psutil.Process], timeout: float = 15.0) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"


def worker_process(pid: int) -> psutil.Process:
    workers = [p for p in children(pid) if "pypto_serving.worker.main" in p.cmdline()]
    assert len(workers) == 1, [p.cmdline() for p in children(pid)]
    return workers[0]


def save_bpe_tokenizer(path: Path, texts: list[str]) -> None:
    """A byte-level BPE tokenizer (300 entries, <s> and </s>) trained on `texts`, with its
    tokenizer_config.json, into checkpoint directory `path`."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
