"""Gemma 3 on the cpu backend's C decoder kernels (its norms, its q/k norms in place, the
sliding-window layers' attention) against the portable kernels over the same packed weights,
and batch invariance with them."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.kernels import cpu
from pypto_serving.kernels.decoder_ops import PORTABLE
from tests.worker.test_decoder_stack import PROMPTS, steps_of_every_kind
from tests.worker.tiny_models import GEMMA3_WINDOW, Driver

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no AVX2/FMA/F16C CPU or no C compiler")
# Float activations: the kernels differ from the portable ones in summation order only, and in
# the float16 cache that moves a rounding now and then (a key or value by one fp16 step).
ATOL = {"float32": 1e-4, "float16": 1e-3}


def portable_ops(d: Driver) -> Driver:
    """The same runner with every module's decoder ops the portable ones."""
    for module in d.runner.model.modules():
        if hasattr(module, "ops"):
            module.ops = PORTABLE
    return d


@pytest.mark.parametrize("name", ["gemma3", "gemma3_softcap"])
@pytest.mark.parametrize("kv", ["float16", "float32"])
def test_c_kernels_equal_the_portable_ones(driver, name: str, kv: str) -> None:
    """Prefill, decode, mixed steps and a cached prefix, over prompts longer than the window."""
    config = {"quantization": "int4", "kv_cache_dtype": kv, "activation_quantization": "none"}
    fast, _ = driver(name, **config)
    slow = portable_ops(driver(name, **config)[0])
    # the per-layer path on both sides: the one-call stack runs the C kernels whatever the
    # modules' ops (tests/worker/test_decoder_stack.py holds it to this path bit for bit)
    fast.runner.stack = slow.runner.stack = None
    assert fast.runner.model.model.layers[0].self_attn.ops.attend is not PORTABLE.attend
    assert max(map(len, PROMPTS)) > 2 * GEMMA3_WINDOW
    got, want = steps_of_every_kind(fast), steps_of_every_kind(slow)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL[kv], rtol=0)
    assert fast.tokens == slow.tokens


def per_layer(d: Driver, stack: bool) -> Driver:
    """`d`, or `d` on the per-layer path (no one-call stack)."""
    if not stack:
        d.runner.stack = None
    return d


@pytest.mark.parametrize("stack", [True, False])
@pytest.mark.parametrize("activations", ["none", "int8"])
def test_decode_rows_of_mixed_steps_equal_decode_only_steps(driver, activations: str, stack: bool) -> None:
    """Bit for bit, as for Llama (tests/worker/test_decoder_stack.py): a sequence decoding past
    the window next to another's prefill chunks gets the logits of a decode-only step."""
    config = {"quantization": "int4", "activation_quantization": activations}
    alone, mixed = (per_layer(driver("gemma3", **config)[0], stack) for _ in range(2))
    want, got = [], []
    for d, out, joins in ((alone, want, False), (mixed, got, True)):
        d.step([d.add(0, PROMPTS[0], len(PROMPTS[0]))])
        for step in range(4):
            seqs = [d.next(0)]
            if joins:
                seqs.insert(step % 2, d.add(1 + step, PROMPTS[2], 5))
            out.append(d.step(seqs)[1][0])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("stack", [True, False])
def test_prefill_equals_chunked_prefill_and_decoding(driver, stack: bool) -> None:
    """Bit for bit with int8 activations: a prompt longer than the window prefilled whole,
    in chunks across the window, or token by token gives the same last logits."""
    config = {"quantization": "int4", "activation_quantization": "int8"}
    prompt = PROMPTS[3]
    whole, chunked, stepped = (per_layer(driver("gemma3", **config)[0], stack) for _ in range(3))
    want = whole.step([whole.add(0, prompt, len(prompt))])[1][0]
    chunked.step([chunked.add(0, prompt, 7)])
    chunked.step([chunked.next(0, 9)])
    got = chunked.step([chunked.next(0, len(prompt) - 16)])[1][0]
    stepped.step([stepped.add(0, prompt, 1)])
    for _ in range(len(prompt) - 2):
        stepped.step([stepped.next(0)])
    last = stepped.step([stepped.next(0)])[1][0]
    assert torch.equal(got, want) and torch.equal(last, want)
