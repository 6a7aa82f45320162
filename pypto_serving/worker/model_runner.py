"""ModelRunner: weights, KV cache and per-sequence state of one device; executes StepPlans.

execute(plan) = drop finished -> update sequence states -> prepare -> forward -> sample
(-> constrained sequences' matchers consume their tokens). Everything that differs between
devices is the backend's (backends/), chosen once from `--backend`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pypto_serving.backends import make_backend
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.kernels.sampling import SamplerOutput, sample
from pypto_serving.loader.hf import count_safetensors, load_safetensors
from pypto_serving.messages.worker import (
    ScheduledSeq,
    StepPlan,
    StepResult,
    TopLogprob,
    WorkerConfig,
)
from pypto_serving.models import build_model, load_weights
from pypto_serving.worker.batch import StepBatch, prepare
from pypto_serving.worker.grammar import Grammars, advance
from pypto_serving.worker.kv_cache import (
    KVCache,
    allocate_kv_cache,
    bytes_per_block,
    num_kv_blocks,
)
from pypto_serving.worker.memory import module_bytes
from pypto_serving.worker.progress import with_progress
from pypto_serving.worker.sampler_state import sampling_tensors
from pypto_serving.worker.seq_state import SeqState, apply_scheduled

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
        self.dtype = torch_dtype(cfg.dtype)
        self.backend = make_backend(cfg.backend, cfg.device, self.dtype)
        self.device = self.backend.device
        self.backend.before_loading()
        self.kv_dtype = torch_dtype(cfg.kv_cache_dtype, auto=self.dtype)
        layers = self.backend.layers(cfg.quantization, cfg.activation_quantization)
        self.kernels, self.activation_quantization = self.backend.kernels_used(
            cfg.quantization, cfg.activation_quantization)
        self.model = build_model(cfg.arch, self.dtype, self.device, cfg.max_model_len, layers)
        load_weights(self.model, cfg.arch, weight_source(cfg))
        self.weight_bytes = module_bytes(self.model)
        self.seqs: dict[int, SeqState] = {}
        self.grammars = Grammars(cfg.tokenizer_json, cfg.arch.vocab_size, cfg.eos_token_id)
        block_bytes = bytes_per_block(cfg.arch, cfg.block_size, self.kv_dtype)
        self.num_blocks = num_kv_blocks(self._kv_budget(), block_bytes, cfg.max_num_blocks)
        self.kv_cache_bytes = self.num_blocks * block_bytes
        self.kv_caches = self._allocate(self.num_blocks)
        self.stack = self.backend.stack(self.model, self.kv_caches)
        self.backend.after_loading()

    def idle(self) -> None:
        """Called when no step came for a while."""
        self.backend.idle()

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
        self.backend.after_step(batch.attn.all_decode)
        logits = self._forward(batch, self.kv_caches)
        sampled = [st for s, st in zip(plan.seqs, states, strict=True) if s.sample]
        if not sampled:
            return StepResult(plan.step_id, [], []), logits
        tensors = sampling_tensors(sampled, self.cfg.arch.vocab_size, self.device, self.grammars)
        out = sample(logits, tensors, self.backend.argmax)
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
        return allocate_kv_cache(arch, num_blocks, bs, self.kv_dtype, self.backend.zeros)

    def _kv_budget(self) -> int:
        cfg = self.cfg
        # The sampler holds a few [max_num_seqs, vocab] float32 copies of the logits.
        sampler_bytes = 8 * cfg.max_num_seqs * cfg.arch.vocab_size * 4
        return self.backend.kv_budget(cfg.kv_cache_bytes, cfg.gpu_memory_utilization, self.weight_bytes,
                                      self._largest_step, sampler_bytes)

    @torch.inference_mode()
    def _largest_step(self) -> None:
        """One prefill of the whole token budget, on caches of its own (freed on return)."""
        cfg = self.cfg
        tokens = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        blocks = -(-tokens // cfg.block_size)
        seq = _dummy_seq(tokens, blocks)
        state = apply_scheduled({}, seq, self.device)
        self._forward(prepare([seq], [state], cfg.block_size, self.device), self._allocate(blocks))


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
