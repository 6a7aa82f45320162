"""Constrained decoding in the worker's sampler: random-weight models still emit valid JSON."""

from __future__ import annotations

import json

import llguidance
import msgspec
import pytest
import structlog
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.kernels.sampling import apply_token_bitmask
from pypto_serving.messages.worker import StepPlan
from pypto_serving.telemetry.profiling import WorkerProfiler
from pypto_serving.worker.main import _execute
from tests.worker.tiny_models import Driver

PROMPT = [(5 * i + 11) % 256 for i in range(9)]
EOS = 255  # the tiny models' last token; byte 0xFF never occurs in UTF-8 text
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
    # No free whitespace: random weights would otherwise pad with whitespace forever.
    "x-guidance": {"whitespace_flexible": False},
}
GRAMMAR = llguidance.grammar_from("json_schema", json.dumps(SCHEMA))
SAMPLED = dict(temperature=1.5, top_k=20, seed=7, presence_penalty=0.5, frequency_penalty=0.3,
               repetition_penalty=1.2)


def byte_tokenizer_json() -> str:
    """Tokens 0..254 are the single bytes 0..254 (GPT-2 byte-level spelling), 255 is EOS."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(255)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>"])
    return tok.to_str()


TOKENIZER_JSON = byte_tokenizer_json()


def constrained_driver(driver, name: str = "llama") -> Driver:
    return driver(name, tokenizer_json=TOKENIZER_JSON, eos_token_id=EOS)[0]


def generate(d: Driver, params: dict[int, SamplingParams], steps: int = 60) -> dict[int, list[int]]:
    """Steps every sequence (all on PROMPT) until it samples EOS or `steps` run out."""
    d.step([d.add(seq_id, PROMPT, len(PROMPT), p) for seq_id, p in params.items()])
    for _ in range(steps - 1):
        live = [seq_id for seq_id in params if d.tokens[seq_id][-1] != EOS]
        if not live:
            break
        d.step([d.next(seq_id) for seq_id in live])
    return {seq_id: d.tokens[seq_id][len(PROMPT):] for seq_id in params}


def assert_valid(output: list[int]) -> None:
    """Ends with (a single) EOS, and the text before it validates against SCHEMA."""
    assert output[-1] == EOS and EOS not in output[:-1], output
    value = json.loads(bytes(output[:-1]).decode())
    assert list(value) == ["n"] and type(value["n"]) is int, value


@pytest.mark.parametrize("name", ["llama", "qwen2_tied"])
@pytest.mark.parametrize("settings", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_output_validates_and_other_rows_are_untouched(driver, name: str, settings: dict) -> None:
    constrained = SamplingParams(grammar=GRAMMAR, **settings)
    free = SamplingParams(temperature=1.0, seed=3)
    batched = generate(constrained_driver(driver, name), {1: constrained, 2: free})
    assert_valid(batched[1])
    assert batched[1] == generate(constrained_driver(driver, name), {1: constrained})[1]
    assert batched[2] == generate(constrained_driver(driver, name), {2: free})[2]
    assert any(t >= 128 for t in batched[2])  # not confined to JSON's ASCII


@pytest.mark.parametrize("settings", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_matcher_survives_preemption(driver, settings: dict) -> None:
    params = SamplingParams(grammar=GRAMMAR, **settings)
    expected = generate(constrained_driver(driver), {1: params})[1]
    assert len(expected) > 6
    d = constrained_driver(driver)
    generate(d, {1: params}, steps=5)
    # Recompute: prompt + 3 outputs (3 full blocks) are prefix-cache hits, the rest is rerun.
    known = d.tokens[1]
    restart = d.add(1, known, len(known), params, shared_blocks=d.blocks[1][:3])
    assert restart.prefix_ids == known[:12]
    d.step([msgspec.structs.replace(restart, num_prompt_tokens=len(PROMPT))])
    while d.tokens[1][-1] != EOS and len(d.tokens[1]) < 100:
        d.step([d.next(1)])
    assert d.tokens[1][len(PROMPT):] == expected
    assert_valid(expected)


def test_grammar_without_tokenizer_is_a_clear_error(driver) -> None:
    d, _ = driver("llama")
    plan = StepPlan(0, [d.add(1, PROMPT, len(PROMPT), SamplingParams(grammar=GRAMMAR))])
    with pytest.raises(ValueError, match="tokenizer_json is empty"):
        d.runner.execute(plan)
    result = _execute(d.runner, plan, WorkerProfiler("test", ("cpu",)))
    assert result.error is not None and "tokenizer_json is empty" in result.error


def test_min_tokens_does_not_hold_back_a_complete_grammar(driver) -> None:
    params = SamplingParams(grammar=GRAMMAR, min_tokens=50, eos_token_ids=(EOS,))
    output = generate(constrained_driver(driver), {1: params})[1]
    assert len(output) < 50
    assert_valid(output)


def test_a_broken_grammar_ends_its_row_with_eos(driver) -> None:
    with structlog.testing.capture_logs() as logs:
        output = generate(constrained_driver(driver), {1: SamplingParams(grammar="start: {{")})[1]
    assert output == [EOS]
    assert any(e["log_level"] == "warning" and "start: {{" in e["error"] for e in logs)


def test_bitmask_masks_only_its_rows() -> None:
    vocab = 70  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(3, vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32)
    out = apply_token_bitmask(logits, torch.tensor([0, 2]), bitmask)
    for r, row in enumerate([0, 2]):
        allowed = [(bitmask[r, j // 32].item() >> (j % 32)) & 1 == 1 for j in range(vocab)]
        expected = logits[row].masked_fill(~torch.tensor(allowed), float("-inf"))
        assert torch.equal(out[row], expected)
    assert torch.equal(out[1], logits[1])
