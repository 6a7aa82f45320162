"""ModelRunner's step contract: results, per-sequence state, seeds, KV sizing."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pypto_serving.backends.cuda import CudaBackend
from pypto_serving.backends.graphs import GraphSpec
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.kernels import cpu
from pypto_serving.messages.worker import PLACEHOLDER, ScheduledSeq, StepPlan
from pypto_serving.worker.kv_cache import bytes_per_block
from pypto_serving.worker.model_runner import ModelRunner
from tests.worker.tiny_models import Driver, worker_config

PROMPT = [(5 * i + 11) % 256 for i in range(9)]
SAMPLED = SamplingParams(temperature=1.0, seed=1234)


def generate(d: Driver, seq_id: int, n: int, params: SamplingParams, others: int = 0) -> list[int]:
    """n tokens of one sequence, optionally batched with `others` unrelated sampled sequences."""
    other_ids = [100 + i for i in range(others)]
    first = [d.add(seq_id, PROMPT, len(PROMPT), params)]
    first += [d.add(o, PROMPT[o % 5 :], 9, SamplingParams(temperature=1.0)) for o in other_ids]
    d.step(first)
    for _ in range(n - 1):
        d.step([d.next(s) for s in [*other_ids[:1], seq_id, *other_ids[1:]]])
    return d.tokens[seq_id][len(PROMPT) :]


def test_result_lists_only_sampled_seqs_in_plan_order(driver) -> None:
    d, _ = driver("llama")
    result, logits = d.step([d.add(1, PROMPT, 4), d.add(2, PROMPT, 9), d.add(3, PROMPT[:3], 3)])
    assert result.seq_ids == [2, 3]
    assert len(result.token_ids) == 2 and logits.shape == (2, 256)
    assert result.logprobs == [] and result.top_logprobs == []


def test_logprobs_are_log_softmax_of_the_logits(driver) -> None:
    d, _ = driver("llama")
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(logprobs=0)]
    result, logits = d.step([d.add(i, PROMPT[i:], 9 - i, p) for i, p in enumerate(params)])
    expected = logits.log_softmax(-1)
    chosen = expected[torch.arange(3), torch.tensor(result.token_ids)]
    assert result.logprobs[0] == pytest.approx(chosen[0].item(), abs=1e-5)
    assert result.logprobs[1] == 0.0  # not asked
    assert result.logprobs[2] == pytest.approx(chosen[2].item(), abs=1e-5)
    top = result.top_logprobs[0]
    assert [t.token_id for t in top] == expected[0].topk(3).indices.tolist()
    assert [t.logprob for t in top] == pytest.approx(expected[0].topk(3).values.tolist(), abs=1e-5)
    assert result.top_logprobs[1] == [] and result.top_logprobs[2] == []


def test_seeded_sequence_is_the_same_alone_and_batched(driver) -> None:
    alone = generate(driver("llama")[0], 1, 12, SAMPLED)
    batched = generate(driver("llama")[0], 1, 12, SAMPLED, others=3)
    assert alone == batched
    other_seed = generate(driver("llama")[0], 1, 12, SamplingParams(temperature=1.0, seed=99))
    assert other_seed != alone


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_packed_weights_keep_greedy_tokens_batch_invariant(driver, quantization: str) -> None:
    """The CPU kernels give a row the same bits at any batch size: alone (M = 1) and among
    others (M = 4, prefill chunks mixed in) must agree."""
    alone = generate(driver("llama", quantization=quantization)[0], 1, 12, SamplingParams())
    batched = generate(driver("llama", quantization=quantization)[0], 1, 12, SamplingParams(), others=3)
    assert alone == batched


def test_preempted_sequence_continues_its_random_stream(driver) -> None:
    expected = generate(driver("llama")[0], 1, 10, SAMPLED)
    d, _ = driver("llama")
    generate(d, 1, 5, SAMPLED)
    # Preemption by recompute: the scheduler restarts seq 1 with prompt + 5 outputs.
    known = d.tokens[1]
    restart = ScheduledSeq(
        1, known, 0, d.alloc(4), True, reset=True, num_prompt_tokens=len(PROMPT), sampling=SAMPLED
    )
    d.blocks[1], d.computed[1] = list(restart.new_block_ids), len(known)
    d.step([restart])
    for _ in range(4):
        d.step([d.next(1)])
    assert d.tokens[1][len(PROMPT) :] == expected


def test_finished_sequences_are_forgotten(driver) -> None:
    d, _ = driver("llama")
    d.step([d.add(1, PROMPT, 9)])
    d.step([], finished=[1])
    assert 1 not in d.runner.seqs
    with pytest.raises(KeyError):
        d.step([d.next(1)])


def test_min_tokens_holds_back_eos(driver) -> None:
    d, _ = driver("llama")
    free_run = generate(d, 1, 6, SamplingParams())
    eos = free_run[0]  # the token greedy decoding picks first
    d, _ = driver("llama")
    held = generate(d, 1, 6, SamplingParams(min_tokens=3, eos_token_ids=(eos,)))
    assert eos not in held[:3]
    d, _ = driver("llama")
    assert generate(d, 1, 1, SamplingParams(min_tokens=0, eos_token_ids=(eos,))) == [eos]


def test_kv_blocks_fill_the_cpu_budget_up_to_the_cap(checkpoint) -> None:
    path, _ = checkpoint("llama")
    cfg = worker_config(path, kv_cache_bytes=10_000, max_num_blocks=1000)
    block = bytes_per_block(cfg.model.arch, cfg.kv_cache.block_size, torch.float32)
    runner = ModelRunner(cfg)
    assert runner.num_blocks == 10_000 // block
    assert runner.kv_cache_bytes == runner.num_blocks * block
    assert runner.kv_caches[0][0].shape == (runner.num_blocks, 4, 2, 16)
    assert ModelRunner(worker_config(path, max_num_blocks=7)).num_blocks == 7
    params = sum(p.numel() for p in runner.model.parameters())
    assert runner.weight_bytes >= params * 4


def test_a_budget_below_one_block_is_a_clear_error(checkpoint) -> None:
    path, _ = checkpoint("llama")
    with pytest.raises(ValueError, match="KV cache budget"):
        ModelRunner(worker_config(path, kv_cache_bytes=100))


def test_bfloat16_kv_cache_under_float32_weights(driver) -> None:
    d, o = driver("llama", kv_cache_dtype="bfloat16")
    assert d.runner.kv_caches[0][0].dtype == torch.bfloat16
    _, logits = d.step([d.add(1, PROMPT, 9)])
    torch.testing.assert_close(logits[0], o.logits(PROMPT)[-1], atol=0.05, rtol=0)


def test_empty_plan_only_drops_state(driver) -> None:
    d, _ = driver("llama")
    result = d.runner.execute(StepPlan(7, [], []))
    assert (result.step_id, result.seq_ids, result.token_ids) == (7, [], [])


class FakeAccelerator:
    """The slice of torch.cuda's memory API the runner uses, with fixed numbers."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def synchronize(self, device: torch.device) -> None:
        self.calls.append("synchronize")

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self.calls.append("reset")

    def memory_allocated(self, device: torch.device) -> int:
        return 1_000

    def max_memory_allocated(self, device: torch.device) -> int:
        return 6_000

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def memory_reserved(self, device: torch.device) -> int:
        return 2_000

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return 10_000_000 - 2_000, 10_000_000


def test_accelerator_budget_leaves_room_for_weights_and_activations(checkpoint, monkeypatch) -> None:
    path, _ = checkpoint("llama")
    cfg = worker_config(path, max_num_batched_tokens=40)  # a 40-token profiling prefill
    runner = ModelRunner(cfg)
    fake = FakeAccelerator()
    monkeypatch.setattr(CudaBackend, "memory", property(lambda self: fake))
    runner.backend = CudaBackend("cpu", torch.float32)  # the accelerator's accounting, on the CPU
    sampler = 8 * cfg.limits.max_num_seqs * cfg.model.arch.vocab_size * 4
    activations = 5_000 + sampler
    util = cfg.kv_cache.gpu_memory_utilization
    assert runner._kv_budget().bytes == int(util * 10_000_000) - runner.weight_bytes - activations
    assert fake.calls == ["synchronize", "reset", "empty_cache"]
    assert runner.seqs == {}  # the profiling sequence leaves no state behind
    budget = CudaBackend("cpu", torch.float32).kv_budget(0, 0.5, 100, lambda: 40, 200)
    assert budget.bytes == 5_000_000 - 100 - 5_000 - 200  # util x total - weights - peak - sampler
    graphs = GraphSpec((1, 2, 4), 64)  # 4 rows of the 40-token step's 5_000 bytes, 4 x 68 + 64 slots
    budget = CudaBackend("cpu", torch.float32).kv_budget(0, 0.5, 100, lambda: 40, 200, graphs)
    assert budget.bytes == 5_000_000 - 100 - 5_000 - 200 - (500 + 8 * (4 * 68 + 64))


def test_server_seed_makes_unseeded_requests_repeatable(driver) -> None:
    """`--seed`: the same unseeded requests in the same order sample the same tokens in every
    run (vLLM's global seed); without it each run draws its own."""
    unseeded = SamplingParams(temperature=1.0)
    runs = [generate(driver("llama", seed=7)[0], 1, 12, unseeded) for _ in range(2)]
    assert runs[0] == runs[1]
    other = generate(driver("llama", seed=8)[0], 1, 12, unseeded)
    free = generate(driver("llama")[0], 1, 12, unseeded)
    assert other != runs[0] and free != runs[0]
    seeded = SamplingParams(temperature=1.0, seed=99)  # a request's own seed still wins
    assert generate(driver("llama", seed=7)[0], 1, 12, seeded) == generate(driver("llama")[0], 1, 12, seeded)


def test_a_placeholder_token_is_the_one_sampled_for_the_sequence_in_the_step_before(driver) -> None:
    """Async scheduling sends a decode step before the worker has answered the one before:
    its token is PLACEHOLDER, and the worker reads it as the token it sampled there."""
    want = generate(driver("llama")[0], 1, 6, SamplingParams())
    d, _ = driver("llama")
    d.step([d.add(1, PROMPT, len(PROMPT))])
    for _ in range(5):
        d.step([msgspec.structs.replace(d.next(1), token_ids=[PLACEHOLDER])])
    assert d.tokens[1][len(PROMPT):] == want
    with pytest.raises(ValueError, match="placeholder"):
        d.step([ScheduledSeq(2, [PLACEHOLDER], 0, d.alloc(1), True, reset=True, num_prompt_tokens=1,
                             sampling=SamplingParams())])


@pytest.mark.skipif(not cpu.available() or not cpu.vnni(), reason="the greedy head needs AVX-512 VNNI")
def test_greedy_steps_take_their_tokens_from_the_greedy_head(driver) -> None:
    """A step whose tokens are all raw argmaxes (greedy, no penalty, mask or logprobs) takes them
    from the head's greedy kernel without the logits (on the CPU's int8 head): the same tokens
    as the logits' argmax, step for step; a step that wants more computes the logits."""
    fast, _ = driver("llama", quantization="int4", activation_quantization="mixed")
    slow, _ = driver("llama", quantization="int4", activation_quantization="mixed")
    heads: list[int] = []
    logits_of = fast.runner.model.compute_logits
    fast.runner.model.compute_logits = lambda h: heads.append(h.shape[0]) or logits_of(h)
    ids = range(1, 6)
    plans = [[d.add(i, PROMPT[i:], len(PROMPT) - i) for i in ids] for d in (fast, slow)]
    for _ in range(8):
        result = fast.runner.execute(StepPlan(fast.step_id, plans[0]))
        fast.step_id += 1
        for seq_id, token in zip(result.seq_ids, result.token_ids, strict=True):
            fast.tokens[seq_id].append(token)
        slow.step(plans[1])
        plans = [[d.next(i) for i in ids] for d in (fast, slow)]
    assert heads == [] and fast.tokens == slow.tokens
    wants_logprobs = fast.add(9, PROMPT, len(PROMPT), SamplingParams(logprobs=1))
    fast.runner.execute(StepPlan(fast.step_id, [wants_logprobs]))
    assert heads == [1]
