"""The one-call decoder stack gives exactly the per-layer path's logits in every kind of step
(prefill, decode, and the two mixed), and is used for all of them (Llama, Qwen2/3 and Gemma 3
layers)."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.kernels import cpu
from pypto_serving.loader.gguf_file import arch_from_gguf
from pypto_serving.messages.worker import ModelConfig, ModelFormat
from pypto_serving.models.quant import QuantLinear
from pypto_serving.worker.model_runner import ModelRunner
from tests.worker.tiny_models import BLOCK_SIZE, Driver, worker_config, write_tiny_gguf

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no AVX2/FMA/F16C CPU or no C compiler")
PROMPTS = [[(5 * i + 11 + j) % 256 for i in range(n)] for j, n in enumerate((9, 3, 14, 23))]


def steps_of_every_kind(d: Driver) -> list[torch.Tensor]:
    """Prefill three sequences of different lengths, decode them, then steps where a fourth
    prompt's chunks come first (so the decode rows are not the step's first rows), one where
    its prefix is cached, and decode steps again. The logits of every step."""
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]
    out = [d.step([d.add(i, p, len(p), params[i]) for i, p in enumerate(PROMPTS[:3])])[1]]
    out.append(d.step([d.next(i) for i in range(3)])[1])
    for _ in range(2):  # the fourth prompt in chunks of 5 and 6 rows next to three decode rows
        first = d.add(3, PROMPTS[3], 5, params[3]) if 3 not in d.tokens else d.next(3, 6)
        out.append(d.step([first, *(d.next(i) for i in range(3))])[1])
    shared = d.blocks[3][: d.computed[3] // BLOCK_SIZE]  # the full blocks of its first two chunks
    out.append(d.step([d.next(0), d.add(4, PROMPTS[3], 16, params[3], shared_blocks=shared), d.next(1)])[1])
    for _ in range(3):
        out.append(d.step([d.next(i) for i in (0, 1, 2, 4)])[1])
    return out


@pytest.mark.parametrize(("name", "kv", "activations"), [
    ("llama", "float16", "none"), ("llama", "float32", "none"), ("llama", "float16", "int8"),
    ("qwen2_tied", "float16", "none"), ("qwen2_tied", "float32", "int8"),  # qwen2: q/k/v bias
    ("qwen3", "float16", "int8"), ("qwen3_wide", "float16", "none"),  # q/k norms; head_dim 128
    # Gemma 3: (1 + w) norms, post-norms, GeGLU, sliding windows with their own rotary table
    ("gemma3", "float16", "int8"), ("gemma3", "float32", "none"), ("gemma3_softcap", "float16", "int16"),
    ("llama", "float16", "mixed"),  # int8, with a second plane for each row's outlier groups
    ("llama_3_layers", "float16", "mixed"),  # two mixed layers, then the last's int16
])
def test_stack_equals_the_per_layer_path_bit_for_bit(driver, name: str, kv: str, activations: str) -> None:
    config = {"quantization": "int4", "kv_cache_dtype": kv, "activation_quantization": activations}
    fast, _ = driver(name, **config)
    slow, _ = driver(name, **config)
    assert fast.runner.stack is not None
    slow.runner.stack = None
    calls = []
    stack = fast.runner.stack
    fast.runner.stack = type("Counting", (), {
        "applies": lambda self, *a: stack.applies(*a),
        "__call__": lambda self, *a: calls.append(1) or stack(*a)})()
    got, want = steps_of_every_kind(fast), steps_of_every_kind(slow)
    assert len(calls) == len(got) == 8  # every step
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert fast.tokens == slow.tokens


@pytest.mark.parametrize("activations", ["none", "int8", "int16", "mixed"])
def test_stack_reads_int5_weights_as_the_per_layer_path(tmp_path, activations: str) -> None:
    """A Q5_0 GGUF's linears pack to int5 under auto; the stack and the per-layer path agree bit
    for bit on them too."""
    path = str(write_tiny_gguf(tmp_path / "q5_0.gguf", "qwen2_tied", linear_type="Q5_0"))
    model = ModelConfig(path, ModelFormat.GGUF, arch_from_gguf(path))

    def make() -> Driver:
        config = worker_config(model, quantization="auto", activation_quantization=activations)
        return Driver(ModelRunner(config))

    fast, slow = make(), make()
    bits = {m.weight.packed.bits for m in fast.runner.model.modules() if isinstance(m, QuantLinear)}
    assert 5 in bits
    assert fast.runner.stack is not None
    slow.runner.stack = None
    for g, w in zip(steps_of_every_kind(fast), steps_of_every_kind(slow), strict=True):
        assert torch.equal(g, w)
    assert fast.tokens == slow.tokens


def test_no_stack_where_it_does_not_fit(driver) -> None:
    assert driver("llama")[0].runner.stack is None  # exact fp32 weights
    assert driver("qwen3", quantization="int4", dtype="bfloat16")[0].runner.stack is None  # not float32


@pytest.mark.parametrize("activations", ["none", "int8", "mixed"])
def test_decode_rows_of_mixed_steps_equal_decode_only_steps(driver, activations: str) -> None:
    """A sequence decoding next to another's prefill chunk gets the logits it gets in a
    decode-only step: with int8 activations a last-bit difference in attention would flip
    roundings and change greedy text under load."""
    config = {"quantization": "int4", "activation_quantization": activations}
    alone, _ = driver("llama", **config)
    mixed, _ = driver("llama", **config)
    want, got = [], []
    for d, out, joins in ((alone, want, False), (mixed, got, True)):
        d.step([d.add(0, PROMPTS[0], len(PROMPTS[0]))])
        for step in range(4):
            seqs = [d.next(0)]
            if joins:  # another request's prefill in the same step, in chunks of 5 tokens
                seqs.insert(step % 2, d.add(1 + step, PROMPTS[2], 5))
            out.append(d.step(seqs)[1][0])  # the chunk samples nothing
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_mixed_activations_give_the_last_layer_int16_in_both_paths(driver) -> None:
    """The last layer's linears take int16 activations under the mixed default, the others
    mixed ones, and the stack runs each layer's with its own (the bit-for-bit test above then
    covers both kinds in one step)."""
    d, _ = driver("llama_3_layers", quantization="int4", activation_quantization="mixed")
    layers = d.runner.model.model.layers
    kinds = [{m.kernels.activations for m in layer.modules() if isinstance(m, QuantLinear)}
             for layer in layers]
    assert len(layers) > 2
    assert kinds == [{"mixed"}] * (len(layers) - 1) + [{"int16"}]
    assert [layer.planes for layer in d.runner.stack._layers] == [3] * (len(layers) - 1) + [2]


@pytest.mark.parametrize(("name", "activations"), [("llama", "mixed"), ("gemma3", "int8"), ("qwen3", "none")])
def test_the_last_layer_runs_for_the_rows_read_only(driver, name: str, activations: str) -> None:
    """The runner asks the stack for the sampled rows' hidden states only (a prefill chunk's last
    row, none of a chunk that does not end its prompt): it returns those rows alone, each equal
    bit for bit to the same row of a run over every row, and still writes every row's k/v in the
    last layer (the later steps' logits, compared with the per-layer path above, read them)."""
    d, _ = driver(name, quantization="int4", activation_quantization=activations)
    stack, asked = d.runner.stack, []

    last = d.runner.kv_caches[-1]

    def checked(ids, positions, meta, rows=None):
        got = stack(ids, positions, meta, rows)
        if rows is not None:
            written = [c.clone() for c in last]
            full = stack(ids, positions, meta)  # writes every row's k/v again
            assert all(torch.equal(a, b) for a, b in zip(written, last, strict=True))
            assert got.shape == (rows.shape[0], full.shape[1])
            assert torch.equal(got, full[rows])
            asked.append((rows.shape[0], ids.shape[0]))
        return got

    d.runner.stack = type("Checked", (), {"applies": lambda self, *a: stack.applies(*a),
                                          "__call__": lambda self, *a: checked(*a)})()
    steps_of_every_kind(d)
    assert (3, 26) in asked  # the first prefill: three prompts' last rows of 26
    assert (3, 8) in asked  # a 5-row chunk that does not end its prompt next to three decode rows


def test_the_stack_refuses_rows_out_of_order(driver) -> None:
    d, _ = driver("llama", quantization="int4", activation_quantization="int8")
    stack, seen = d.runner.stack, []
    def flipped(ids, positions, meta, rows=None):
        seen.append(1)
        return stack(ids, positions, meta, rows.flip(0))

    d.runner.stack = type("Flipped", (), {"applies": lambda self, *a: stack.applies(*a),
                                          "__call__": lambda self, *a: flipped(*a)})()
    with pytest.raises(ValueError, match="ascend"):
        d.step([d.add(i, p, len(p)) for i, p in enumerate(PROMPTS[:2])])
    assert seen


def test_the_stack_refuses_ids_and_positions_outside_its_tables(driver) -> None:
    """The stack looks up each row's embedding and rotary angles itself: an id past the
    vocabulary or a position past the rotary table is an error naming the bounds, not a read
    past the tables."""
    d, _ = driver("llama", quantization="int4", activation_quantization="int8")
    stack, seen = d.runner.stack, []
    vocab, positions = d.runner.arch.vocab_size, d.runner.model.rope.shape[0]

    def shifted(ids, pos, meta, rows=None):
        seen.append(1)
        bad = (ids.clone().fill_(vocab), pos) if len(seen) == 1 else (ids, pos.clone().fill_(positions))
        return stack(*bad, meta, rows)

    d.runner.stack = type("Shifted", (), {"applies": lambda self, *a: stack.applies(*a),
                                          "__call__": lambda self, *a: shifted(*a)})()
    for _ in range(2):
        with pytest.raises(ValueError, match=rf"token ids must lie in 0 \.\. {vocab - 1} and positions in "
                                             rf"0 \.\. {positions - 1}"):
            d.step([d.add(0, PROMPTS[0], len(PROMPTS[0]))])
    assert len(seen) == 2
