"""ModelRunner: weights, KV cache and per-sequence state of one device; executes StepPlans.

execute(plan) = drop finished -> update sequence states -> prepare -> forward -> sample
(-> constrained sequences' matchers consume their tokens).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from pypto_serving.actors.device_worker import (
    ScheduledSeq,
    StepPlan,
    StepResult,
    TopLogprob,
    WorkerConfig,
)
from pypto_serving.kernels.sampling import SamplerOutput, sample
from pypto_serving.loader.hf import count_safetensors, load_safetensors
from pypto_serving.models import LayerFactory, build_model, load_weights
from pypto_serving.models.decoder_stack import DecoderStack
from pypto_serving.sampling import SamplingParams
from pypto_serving.worker.batch import StepBatch, prepare
from pypto_serving.worker.grammar import Grammars, advance
from pypto_serving.worker.kv_cache import (
    KVCache,
    allocate_kv_cache,
    bytes_per_block,
    num_kv_blocks,
)
from pypto_serving.worker.memory import (
    accelerator,
    accelerator_kv_budget,
    module_bytes,
    release_freed_memory,
    reuse_freed_memory,
    trim_freed_memory,
)
from pypto_serving.worker.progress import with_progress
from pypto_serving.worker.sampler_state import sampling_tensors
from pypto_serving.worker.seq_state import SeqState, apply_scheduled

TRIM_INTERVAL_S = 2.0  # the heap goes back to the OS at most this often while serving
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str, auto: torch.dtype | None = None) -> torch.dtype:
    """ "float32" | "bfloat16" | "float16", or "auto" -> `auto`."""
    if name == "auto" and auto is not None:
        return auto
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def weight_source(cfg: WorkerConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if cfg.model_format == "hf":
        return with_progress(load_safetensors(cfg.model_path), count_safetensors(cfg.model_path),
                             "loading weights")
    if cfg.model_format == "gguf":
        # Imported here: only GGUF checkpoints need the GGUF reader.
        from pypto_serving.loader.gguf_file import load_gguf_tensors
        from pypto_serving.loader.gguf_reader import read_gguf

        total = len(read_gguf(cfg.model_path).tensors)
        return with_progress(load_gguf_tensors(cfg.model_path, cfg.arch), total, "loading weights")
    raise ValueError(f"unknown model format {cfg.model_format!r}; expected 'hf' or 'gguf'")


class ModelRunner:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type != "cpu":
            accelerator(self.device)  # on npu this imports torch_npu before the device is touched
        else:
            release_freed_memory()
        self.dtype = torch_dtype(cfg.dtype)
        self.kv_dtype = torch_dtype(cfg.kv_cache_dtype, auto=self.dtype)
        # The C kernels are the CPU backend's variant of the packed matmul.
        fast = cfg.backend == "cpu" and self.dtype == torch.float32
        layers = LayerFactory(cfg.quantization, fast=fast, activations=cfg.activation_quantization)
        self.kernels, self.activation_quantization = layers.effective_kernels()
        self.model = build_model(cfg.arch, self.dtype, self.device, cfg.max_model_len, layers)
        load_weights(self.model, cfg.arch, weight_source(cfg))
        self.weight_bytes = module_bytes(self.model)
        self.seqs: dict[int, SeqState] = {}
        self.grammars = Grammars(cfg.tokenizer_json, cfg.arch.vocab_size, cfg.eos_token_id)
        block_bytes = bytes_per_block(cfg.arch, cfg.block_size, self.kv_dtype)
        self.num_blocks = num_kv_blocks(self._kv_budget(), block_bytes, cfg.max_num_blocks)
        self.kv_cache_bytes = self.num_blocks * block_bytes
        self.kv_caches = self._allocate(self.num_blocks)
        # Every step in one C call where the per-layer path would use the C kernels anyway.
        self.stack = DecoderStack.build(self.model, self.kv_caches) if fast else None
        self._prefilled = False  # the last step had prefill rows (large activations)
        self._trimmed_at = float("-inf")
        if self.device.type == "cpu":
            trim_freed_memory()  # what loading freed below the mmap threshold
            reuse_freed_memory()

    def idle(self) -> None:
        """Called when no step came for a while: the heap's free pages go back to the OS."""
        if self.device.type == "cpu":
            trim_freed_memory()

    def _after_prefill(self, decode_only: bool) -> None:
        """The first decode-only step after prefill steps returns the heap the prefill
        activations left (kept between prefill steps so they do not page-fault afresh): the
        KV cache grows during decoding, and the two would otherwise add up. At most every
        TRIM_INTERVAL_S, so steady arrivals do not page-fault every prefill afresh."""
        now = time.monotonic()
        if (decode_only and self._prefilled and self.device.type == "cpu"
                and now - self._trimmed_at >= TRIM_INTERVAL_S):
            trim_freed_memory()
            self._trimmed_at = now
        self._prefilled = not decode_only

    def execute(self, plan: StepPlan) -> StepResult:
        return self.execute_with_logits(plan)[0]

    @torch.inference_mode()
    def execute_with_logits(self, plan: StepPlan) -> tuple[StepResult, torch.Tensor]:
        """The step's result and the logits it sampled from ([sampled seqs, vocab], float32)."""
        for seq_id in plan.finished:
            self.seqs.pop(seq_id, None)
        states = [apply_scheduled(self.seqs, s, self.device, self.grammars) for s in plan.seqs]
        if not plan.seqs:
            return StepResult(plan.step_id, [], []), torch.empty(0, self.cfg.arch.vocab_size)
        batch = prepare(plan.seqs, states, self.cfg.block_size, self.device)
        self._after_prefill(batch.attn.all_decode)
        logits = self._forward(batch, self.kv_caches)
        sampled = [st for s, st in zip(plan.seqs, states, strict=True) if s.sample]
        if not sampled:
            return StepResult(plan.step_id, [], []), logits
        out = sample(logits, sampling_tensors(sampled, self.cfg.arch.vocab_size, self.device, self.grammars))
        result = step_result(plan.step_id, batch.sample_seq_ids, out, sampled)
        advance([st.matcher for st in sampled], result.token_ids)
        return result, logits

    def _forward(self, batch: StepBatch, kv_caches: list[KVCache]) -> torch.Tensor:
        if self.stack is not None and self.stack.applies(batch.attn, kv_caches):
            hidden = self.stack(batch.input_ids, batch.positions, batch.attn)
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch.attn, kv_caches)
        # Only the last token of each sampled chunk goes through lm_head.
        return self.model.compute_logits(hidden[batch.sample_rows]).float()

    def _allocate(self, num_blocks: int) -> list[KVCache]:
        arch, bs = self.cfg.arch, self.cfg.block_size
        return allocate_kv_cache(arch, num_blocks, bs, self.kv_dtype, self.device)

    def _kv_budget(self) -> int:
        if self.device.type == "cpu":
            return self.cfg.kv_cache_bytes
        util = self.cfg.gpu_memory_utilization
        return accelerator_kv_budget(self.device, util, self.weight_bytes, self._activation_bytes())

    @torch.inference_mode()
    def _activation_bytes(self) -> int:
        """Peak extra memory of the largest step: one prefill of the whole token budget."""
        acc, cfg = accelerator(self.device), self.cfg
        tokens = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        blocks = -(-tokens // cfg.block_size)
        caches = self._allocate(blocks)
        acc.synchronize(self.device)
        acc.reset_peak_memory_stats(self.device)
        before = acc.memory_allocated(self.device)
        seq = _dummy_seq(tokens, blocks)
        state = apply_scheduled({}, seq, self.device)
        self._forward(prepare([seq], [state], cfg.block_size, self.device), caches)
        peak = acc.max_memory_allocated(self.device) - before
        del caches
        acc.empty_cache()
        # The sampler holds a few [max_num_seqs, vocab] float32 copies of the logits.
        return peak + 8 * cfg.max_num_seqs * cfg.arch.vocab_size * 4


def _dummy_seq(tokens: int, blocks: int) -> ScheduledSeq:
    return ScheduledSeq(
        seq_id=-1,
        token_ids=[0] * tokens,
        start_pos=0,
        new_block_ids=list(range(blocks)),
        sample=True,
        reset=True,
        num_prompt_tokens=tokens,
        sampling=SamplingParams(),
    )


def step_result(step_id: int, seq_ids: list[int], out: SamplerOutput, states: list[SeqState]) -> StepResult:
    tokens = out.token_ids.tolist()
    if out.logprobs is None:
        return StepResult(step_id, seq_ids, tokens)
    asked = [s.sampling.logprobs for s in states]
    chosen = [lp if k is not None else 0.0 for lp, k in zip(out.logprobs.tolist(), asked, strict=True)]
    return StepResult(step_id, seq_ids, tokens, chosen, _top_lists(out, asked))


def _top_lists(out: SamplerOutput, asked: list[int | None]) -> list[list[TopLogprob]]:
    if out.top_ids is None:
        return [[] for _ in asked]
    ids, values = out.top_ids.tolist(), out.top_logprobs.tolist()
    return [
        [TopLogprob(t, v) for t, v in zip(ids[i][:k], values[i][:k], strict=True)] if k else []
        for i, k in enumerate(asked)
    ]
