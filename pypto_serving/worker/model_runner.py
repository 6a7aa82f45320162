"""ModelRunner: weights, KV cache and per-sequence state of one device; executes StepPlans.

execute(plan) = drop finished -> update sequence states -> prepare -> forward -> sample
(-> constrained sequences' matchers consume their tokens). Everything that differs between
devices is the backend's (backends/), chosen once from `--backend`. With tensor parallelism
every rank runs the same steps on its part of the model (the collectives are the model's);
rank 0 alone samples and answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgspec
import structlog
import torch

from pypto_serving.backends import make_backend
from pypto_serving.backends.budget import KVBudget
from pypto_serving.backends.graphs import NO_GRAPHS, GraphSpec
from pypto_serving.backends.portable import StackRunner
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.kernels.sampling import SamplerOutput, argmax_only, sample
from pypto_serving.loader.hf import count_safetensors, load_safetensors
from pypto_serving.messages.worker import (
    ModelConfig,
    ModelFormat,
    PromptLogprobs,
    ScheduledSeq,
    StepPlan,
    StepResult,
    TopLogprob,
    WorkerConfig,
)
from pypto_serving.models import build_model, load_weights
from pypto_serving.parallel.sharding import SINGLE, TensorParallel
from pypto_serving.worker.batch import StepBatch, prepare
from pypto_serving.worker.grammar import Grammars, advance
from pypto_serving.worker.kv_cache import (
    LayerCache,
    allocate_kv_cache,
    bytes_per_block,
    forget_blocks,
    num_kv_blocks,
)
from pypto_serving.worker.memory import module_bytes
from pypto_serving.worker.progress import with_progress
from pypto_serving.worker.prompt_logprobs import score_prompts, wants_prompt_logprobs
from pypto_serving.worker.sampler_state import sampling_tensors
from pypto_serving.worker.seq_state import SeqState, apply_scheduled, resolve_placeholders
from pypto_serving.worker.speculative import kept, row_states, verify
from pypto_serving.worker.weight_cache import load_with_cache

log = structlog.get_logger()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str, auto: torch.dtype | None = None) -> torch.dtype:
    """ "float32" | "bfloat16" | "float16", or "auto" -> `auto`."""
    if name == "auto" and auto is not None:
        return auto
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def weight_source(model: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if model.format == ModelFormat.HF:
        return with_progress(load_safetensors(model.path), count_safetensors(model.path), "loading weights")
    if model.format == ModelFormat.GGUF:
        # Imported here: only GGUF checkpoints need the GGUF reader.
        from pypto_serving.loader.gguf_file import load_gguf_tensors
        from pypto_serving.loader.gguf_reader import read_gguf

        gguf = read_gguf(model.path)
        return with_progress(load_gguf_tensors(gguf, model.arch), len(gguf.tensors), "loading weights")
    raise ValueError(f"unknown model format {model.format!r}; expected 'hf' or 'gguf'")


class ModelRunner:
    def __init__(self, cfg: WorkerConfig, tp: TensorParallel = SINGLE,
                 agree: Callable[[int], int] = lambda blocks: blocks, device: str = "") -> None:
        """`tp`: this rank's place in its group; `agree(n)`: the smallest of every rank's n;
        `device`: this rank's torch device ("": `cfg.device.device`, rank 0's)."""
        self.cfg, self.tp = cfg, tp
        if cfg.device.threads:
            torch.set_num_threads(cfg.device.threads)
        self.arch, self.block_size = cfg.model.arch, cfg.kv_cache.block_size
        self.dtype = torch_dtype(cfg.device.dtype)
        self.backend = make_backend(cfg.device.backend, device or cfg.device.device, self.dtype)
        self.device = self.backend.device
        self.backend.before_loading()
        self.kv_dtype = torch_dtype(cfg.device.kv_cache_dtype, auto=self.dtype)
        quant = cfg.quant
        layers = self.backend.layers(quant.weights, quant.activations)
        self.kernels, self.activation_quantization = self.backend.kernels_used(
            quant.weights, quant.activations)
        self.model = build_model(self.arch, self.dtype, self.device, cfg.limits.max_model_len, layers, tp)
        self.weights_from = load_with_cache(
            self.model, cfg, lambda: load_weights(self.model, self.arch, weight_source(cfg.model), tp),
            shard=(tp.rank, tp.size), device=str(self.device))
        self.weight_bytes = module_bytes(self.model)
        self.seqs: dict[int, SeqState] = {}
        self._seeds = None if cfg.seed is None else torch.Generator().manual_seed(cfg.seed)
        self.grammars = Grammars(cfg.grammar.tokenizer_json, self.arch.vocab_size, cfg.grammar.eos_token_id)
        graphs = self._graph_spec()
        self.stack: StackRunner | None = None  # the profiling step runs the per-layer path
        self.kv_caches = self._kv_cache(graphs, agree)
        self.stack = self._stack(graphs)
        self.graph_sizes = list(graphs.sizes) if self.stack is not None and graphs.sizes else []
        self.backend.after_loading()

    def idle(self) -> None:
        """Called when no step came for a while."""
        self.backend.idle()

    def execute(self, plan: StepPlan) -> StepResult:
        return self._execute(plan, keep_logits=False)[0]

    def resolve(self, plan: StepPlan) -> StepPlan:
        """`plan` with its placeholders replaced by the tokens they stand for: what rank 0
        hands the other ranks, which do not sample."""
        seqs = [resolve_placeholders(self.seqs, s) for s in plan.seqs]
        return plan if seqs == plan.seqs else msgspec.structs.replace(plan, seqs=seqs)

    def execute_with_logits(self, plan: StepPlan) -> tuple[StepResult, torch.Tensor]:
        """The step's result and the logits it sampled from ([sampled seqs, vocab], float32)."""
        return self._execute(plan, keep_logits=True)

    @torch.inference_mode()
    def _execute(self, plan: StepPlan, keep_logits: bool) -> tuple[StepResult, torch.Tensor]:
        """Without `keep_logits`, a step whose tokens are all argmaxes of the raw logits takes
        them from the head's kernels where they find them without most logits (the logits
        returned are then empty)."""
        for seq_id in plan.finished:
            self.seqs.pop(seq_id, None)
        seqs = [resolve_placeholders(self.seqs, s) for s in plan.seqs]
        states = [apply_scheduled(self.seqs, s, self.device, self.grammars, self._seeds) for s in seqs]
        forget_blocks(self.kv_caches, [b for s in seqs for b in fresh_blocks(s, self.block_size)])
        if not seqs:
            return StepResult(plan.step_id, [], []), torch.empty(0, self.arch.vocab_size)
        batch = prepare(seqs, states, self.block_size, self.device, self.backend.block_tables)
        sampled = row_states(seqs, states)
        # Built before the forward: a copy to an accelerator from the host waits for the
        # stream, which after the forward is queued would mean waiting for the forward
        tensors = sampling_tensors(sampled, self.arch.vocab_size, self.device, self.grammars) \
            if sampled and not self.tp.rank else None
        self.backend.after_step(batch.attn.all_decode)
        tokens = None  # the sampled rows' argmaxes, from the head (greedy_tokens)
        if wants_prompt_logprobs(seqs, states):  # every row's hidden state is read
            hidden = self._hidden(batch, self.kv_caches)
            logits = self._sample_logits(batch, hidden)
            prompt = score_prompts(seqs, states, hidden, self.model.compute_logits,
                                   self.backend.sampler.logprobs)
        else:  # the sampled rows' only: the stack runs the last layer past its k/v for those alone
            hidden, prompt = self._hidden(batch, self.kv_caches, batch.sample_rows), []
            if not keep_logits and tensors is not None and argmax_only(tensors):
                tokens = self.model.greedy_tokens(hidden)
            logits = self._logits(hidden) if tokens is None else hidden.new_empty(0, self.arch.vocab_size)
        if tensors is None:  # nothing sampled, or a rank other than 0 (it joined every collective)
            return StepResult(plan.step_id, [], [], prompt_logprobs=prompt), logits
        if tokens is not None:
            out = SamplerOutput(tokens, None, None, None)
        else:
            out = sample(logits, tensors, self.backend.sampler)
        seq_ids = batch.sample_seq_ids
        if any(s.num_draft for s in seqs):
            keep = verify(seqs, states, out.token_ids.tolist())
            out, sampled, seq_ids = kept(out, keep), [sampled[i] for i in keep], [seq_ids[i] for i in keep]
        result = step_result(plan.step_id, seq_ids, out, sampled, prompt)
        advance([st.matcher for st in sampled], result.token_ids)
        for state, token in zip(sampled, result.token_ids, strict=True):
            state.last_sampled = token  # (a sequence's last kept row last)
        return result, logits

    def _sample_logits(self, batch: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
        """Only the sampled rows go through lm_head (and, for prompt logprobs, the prompt rows
        of the sequences that asked for them: score_prompts)."""
        return self._logits(hidden[batch.sample_rows])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()

    def _hidden(self, batch: StepBatch, kv_caches: list[LayerCache],
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of every row of the step, or of `rows` (ascending) only."""
        if self.stack is not None and self.stack.applies(batch.attn, kv_caches):
            return self.stack(batch.input_ids, batch.positions, batch.attn, rows)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn, kv_caches)
        return hidden if rows is None else hidden[rows]

    def _allocate(self, num_blocks: int) -> list[LayerCache]:
        arch, bs = self.model.local_arch, self.block_size
        return allocate_kv_cache(arch, num_blocks, bs, self.kv_dtype, self.backend.zeros, self.dtype)

    def _kv_cache(self, graphs: GraphSpec, agree: Callable[[int], int]) -> list[LayerCache]:
        """Sized from the backend's budget; with decode graphs one block more than the
        allocator gets: their padded rows' scratch."""
        block_bytes = bytes_per_block(self.model.local_arch, self.block_size, self.kv_dtype, self.dtype)
        self.budget = self._kv_budget(graphs)
        spare = 1 if graphs.sizes else 0
        blocks = num_kv_blocks(self.budget.bytes - spare * block_bytes, block_bytes,
                               self.cfg.kv_cache.max_num_blocks)
        self.num_blocks = agree(blocks)
        self.kv_cache_bytes = self.num_blocks * block_bytes
        log.info("allocating the KV cache", blocks=self.num_blocks, mib=self.kv_cache_bytes >> 20,
                 dtype=str(self.kv_dtype).removeprefix("torch."), budget=self.budget.how)
        return self._allocate(self.num_blocks + spare)

    def _graph_spec(self) -> GraphSpec:
        """The decode graphs to capture: the backend's sizes, one rank only (the collectives
        stay eager), none with --enforce-eager."""
        if self.cfg.device.enforce_eager or self.tp.size > 1:
            return NO_GRAPHS
        sizes = self.backend.graph_sizes(self.model, self.cfg.limits.max_num_seqs)
        width = -(-self.cfg.limits.max_model_len // self.block_size) * self.block_size
        return GraphSpec(sizes, width) if sizes else NO_GRAPHS

    @torch.inference_mode()
    def _stack(self, graphs: GraphSpec) -> StackRunner | None:
        """The decode graphs where there are any (captured now, over the allocated caches), else
        the backend's whole-stack runner; neither has collectives inside: one rank only."""
        if self.tp.size > 1:
            return None
        if graphs.sizes:
            scratch = self.num_blocks * self.block_size  # the spare block's first slot
            t0 = time.monotonic()
            runner = self.backend.decode_graphs(self.model, self.kv_caches, graphs, scratch)
            log.info("captured decode graphs", sizes=list(graphs.sizes),
                     seconds=round(time.monotonic() - t0, 2))
            return runner
        return self.backend.stack(self.model, self.kv_caches)

    def _kv_budget(self, graphs: GraphSpec = NO_GRAPHS) -> KVBudget:
        kv = self.cfg.kv_cache
        # The sampler holds a few [max_num_seqs, vocab] float32 copies of the logits.
        sampler_bytes = 8 * self.cfg.limits.max_num_seqs * self.arch.vocab_size * 4
        host_bytes = kv.host_bytes // self.tp.size  # the replica's budget, split over its ranks
        return self.backend.kv_budget(host_bytes, kv.gpu_memory_utilization, self.weight_bytes,
                                      self._largest_step, sampler_bytes, graphs)

    @torch.inference_mode()
    def _largest_step(self) -> int:
        """One prefill of the whole token budget, on caches of its own (freed on return); its
        tokens."""
        limits = self.cfg.limits
        tokens = min(limits.max_num_batched_tokens, limits.max_model_len)
        blocks = -(-tokens // self.block_size)
        seq = _dummy_seq(tokens, blocks)
        state = apply_scheduled({}, seq, self.device)
        batch = prepare([seq], [state], self.block_size, self.device, self.backend.block_tables)
        self._sample_logits(batch, self._hidden(batch, self._allocate(blocks)))
        return tokens


def fresh_blocks(seq: ScheduledSeq, block_size: int) -> list[int]:
    """The blocks `seq` is handed afresh this step: appended ones, or with `reset` those past
    its prefix-cache hits (which hold what its prefix computed)."""
    if not seq.reset:
        return seq.new_block_ids
    return seq.new_block_ids[seq.start_pos // block_size:]


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


def step_result(step_id: int, seq_ids: list[int], out: SamplerOutput, states: list[SeqState],
                prompt: list[PromptLogprobs] | None = None) -> StepResult:
    tokens, prompt = out.token_ids.tolist(), prompt or []
    if out.logprobs is None:
        return StepResult(step_id, seq_ids, tokens, prompt_logprobs=prompt)
    asked = [s.sampling.logprobs for s in states]
    chosen = [lp if k is not None else 0.0 for lp, k in zip(out.logprobs.tolist(), asked, strict=True)]
    return StepResult(step_id, seq_ids, tokens, chosen, _top_lists(out, asked), prompt)


def _top_lists(out: SamplerOutput, asked: list[int | None]) -> list[list[TopLogprob]]:
    if out.top_ids is None:
        return [[] for _ in asked]
    ids, values = out.top_ids.tolist(), out.top_logprobs.tolist()
    return [
        [TopLogprob(t, v) for t, v in zip(ids[i][:k], values[i][:k], strict=True)] if k else []
        for i, k in enumerate(asked)
    ]
