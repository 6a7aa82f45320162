"""The packed-weight disk cache: a second start maps what the first one packed and computes
exactly what a cold load does; anything that could change the packed weights misses; a bad
entry is rebuilt; the cache can be turned off."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pypto_serving.app.cli import build_parser
from pypto_serving.app.settings import FlagError, weight_cache_dir
from pypto_serving.loader.gguf_file import arch_from_gguf
from pypto_serving.messages.worker import ModelConfig, ModelFormat
from pypto_serving.models.quant import PackedRows
from pypto_serving.worker import model_runner, weight_cache
from pypto_serving.worker.model_runner import ModelRunner
from tests.worker.tiny_models import Driver, worker_config, write_tiny_gguf

PROMPT = [(5 * i + 11) % 256 for i in range(9)]


@pytest.fixture
def gguf_model(tmp_path: Path) -> ModelConfig:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    return ModelConfig(str(path), ModelFormat.GGUF, arch_from_gguf(path))


def runner(model: ModelConfig, cache: Path | str, **overrides: object) -> ModelRunner:
    overrides = {"quantization": "auto", "activation_quantization": "none"} | overrides
    return ModelRunner(worker_config(model, weight_cache_dir=cache, **overrides))


def greedy(r: ModelRunner, n: int = 6) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after PROMPT, and the prompt's last logits."""
    d = Driver(r)
    _, logits = d.step([d.add(1, PROMPT, len(PROMPT))])
    for _ in range(n - 1):
        d.step([d.next(1)])
    return d.tokens[1][len(PROMPT):], logits


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.pt"))


def test_a_hit_maps_the_packed_weights_and_computes_what_a_cold_load_does(
        gguf_model: ModelConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    uncached = runner(gguf_model, "")
    cold = runner(gguf_model, cache)
    assert (uncached.weights_from, cold.weights_from) == ("uncached", "checkpoint")
    assert len(entries(cache)) == 1
    packed = [m.packed.bits for m in cold.model.modules() if isinstance(m, PackedRows)]
    assert 4 in packed and 8 in packed  # Q4_1 linears to int4, the Q8_0 embedding and head to int8

    def no_checkpoint(*args: object) -> None:
        raise AssertionError("a cache hit read the checkpoint")

    monkeypatch.setattr(model_runner, "load_weights", no_checkpoint)
    warm = runner(gguf_model, cache)
    assert warm.weights_from == "cache"
    tokens, logits = greedy(uncached)
    assert greedy(cold)[0] == tokens
    warm_tokens, warm_logits = greedy(warm)
    assert warm_tokens == tokens and torch.equal(warm_logits, logits)
    assert warm.weight_bytes == cold.weight_bytes


@pytest.mark.parametrize("change", ["packing_version", "quantization", "activations", "dtype", "file"])
def test_what_could_change_the_packed_weights_misses(
        change: str, gguf_model: ModelConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    runner(gguf_model, cache)
    first = entries(cache)
    overrides: dict[str, object] = {}
    if change == "packing_version":
        monkeypatch.setattr(weight_cache, "PACKING_VERSION", weight_cache.PACKING_VERSION + 1)
    elif change == "quantization":
        overrides["quantization"] = "int8"
    elif change == "activations":
        overrides["activation_quantization"] = "int8"
    elif change == "dtype":
        overrides["dtype"] = "bfloat16"
    else:  # the same bytes rewritten: a new mtime
        path = Path(gguf_model.path)
        path.write_bytes(path.read_bytes())
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert runner(gguf_model, cache, **overrides).weights_from == "checkpoint"
    assert runner(gguf_model, cache, **overrides).weights_from == "cache"
    # a new packing or file supersedes the old entry; other flags are entries of their own
    superseded = change in ("packing_version", "file")
    assert (set(first) <= set(entries(cache))) != superseded
    assert len(entries(cache)) == (1 if superseded else 2)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "another_models"])
def test_a_bad_entry_is_ignored_and_rebuilt(damage: str, gguf_model: ModelConfig, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    tokens, _ = greedy(runner(gguf_model, cache))
    [entry] = entries(cache)
    if damage == "truncated":
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    elif damage == "garbage":
        entry.write_bytes(os.urandom(4096))
    else:  # a valid entry whose key is another configuration's
        runner(gguf_model, cache, quantization="int8")
        [other] = [e for e in entries(cache) if e != entry]
        os.replace(other, entry)
    rebuilt = runner(gguf_model, cache)
    assert rebuilt.weights_from == "checkpoint"
    assert greedy(rebuilt)[0] == tokens
    assert runner(gguf_model, cache).weights_from == "cache"


def test_an_unwritable_cache_serves_uncached(gguf_model: ModelConfig, tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    r = runner(gguf_model, blocked / "cache")
    assert r.weights_from == "checkpoint" and greedy(r)[0] == greedy(runner(gguf_model, ""))[0]


def test_an_hf_checkpoint_is_cached_only_when_packed(checkpoint, tmp_path: Path) -> None:
    path, _ = checkpoint("qwen2_tied")
    cache = tmp_path / "cache"
    assert runner(path, cache, quantization="none").weights_from == "uncached"
    assert runner(path, cache, quantization="int8").weights_from == "checkpoint"
    hit = runner(path, cache, quantization="int8")
    assert hit.weights_from == "cache"
    assert greedy(hit)[0] == greedy(runner(path, "", quantization="int8"))[0]


def test_the_flags_choose_the_directory_or_turn_the_cache_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def chosen(*flags: str) -> str:
        return weight_cache_dir(build_parser().parse_args(list(flags)))

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert chosen() == str(tmp_path / "xdg" / "pypto-serving" / "weights")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert chosen() == str(Path.home() / ".cache" / "pypto-serving" / "weights")
    assert chosen("--weight-cache-dir", str(tmp_path / "w")) == str(tmp_path / "w")
    assert chosen("--no-weight-cache") == ""
    with pytest.raises(FlagError, match="--no-weight-cache"):
        chosen("--weight-cache-dir", "")
    with pytest.raises(FlagError, match="only one"):
        chosen("--weight-cache-dir", str(tmp_path), "--no-weight-cache")
    (tmp_path / "f").write_text("")
    with pytest.raises(FlagError, match="--weight-cache-dir"):
        chosen("--weight-cache-dir", str(tmp_path / "f" / "w"))
