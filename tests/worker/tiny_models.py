"""Tiny random HF checkpoints, a stand-in scheduler that drives a ModelRunner, the HF oracle."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import transformers

from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.loader.arch import ModelArch
from pypto_serving.loader.hf import arch_from_hf_config, load_hf_config
from pypto_serving.messages.worker import (
    ActivationQuantization,
    BackendName,
    DeviceConfig,
    DType,
    GrammarConfig,
    KVCacheConfig,
    ModelConfig,
    ModelFormat,
    QuantConfig,
    Quantization,
    ScheduledSeq,
    StepLimits,
    StepPlan,
    StepResult,
    WorkerConfig,
)
from pypto_serving.worker.model_runner import ModelRunner

BLOCK_SIZE = 4  # small, so every sequence spans many blocks
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    initializer_range=0.05,  # peakier logits than the default: greedy has clear winners
    eos_token_id=None,  # generate() must not stop early
    bos_token_id=None,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,  # small, so scaling matters at our positions
)
GEMMA3_WINDOW = 5  # shorter than the test prompts, so the window matters
GEMMA3 = dict(
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    sliding_window=GEMMA3_WINDOW,
    head_dim=32,
    query_pre_attn_scalar=24,  # the query scale is not head_dim's
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 100000.0}},
    pad_token_id=0,
)
CHECKPOINTS: dict[str, tuple[str, dict]] = {
    "llama": ("Llama", {}),
    "llama_3_layers": ("Llama", dict(num_hidden_layers=3)),  # more than one layer before the last
    "llama_rope_llama3": ("Llama", dict(rope_scaling=LLAMA3_ROPE)),
    "qwen2_tied": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3", dict(head_dim=32)),  # head_dim != hidden / heads
    "qwen3_wide": ("Qwen3", dict(head_dim=128)),  # Qwen3-8B's and -14B's head width
    "gemma3": ("Gemma3", GEMMA3),  # tied embeddings (Gemma 3's default)
    "gemma3_softcap": ("Gemma3", dict(GEMMA3, final_logit_softcapping=3.0, tie_word_embeddings=False)),
}
CONFIG_CLASSES = {"Gemma3": "Gemma3TextConfig"}


def build_hf_model(name: str) -> torch.nn.Module:
    prefix, extra = CHECKPOINTS[name]
    config = getattr(transformers, CONFIG_CLASSES.get(prefix, f"{prefix}Config"))(**(COMMON | extra))
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    if prefix == "Gemma3":
        _randomize_norms(model)
    return model


def _randomize_norms(model: torch.nn.Module) -> None:
    """Gemma initialises its norms to zero (a scale of 1 + 0): random ones test the 1 +."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)


def worker_config(model: Path | ModelConfig, **overrides: object) -> WorkerConfig:
    """A cpu worker's config for a tiny HF checkpoint directory (or any `ModelConfig`);
    `overrides` by field name (quantization and activation_quantization are `quant.weights`
    and `quant.activations`, kv_cache_bytes is `kv_cache.host_bytes`)."""
    if not isinstance(model, ModelConfig):
        model = ModelConfig(str(model), ModelFormat.HF, arch_from_hf_config(load_hf_config(model)))
    defaults = dict(dtype="float32", kv_cache_dtype="auto", backend="cpu", device="cpu",
                    block_size=BLOCK_SIZE, max_num_blocks=256, kv_cache_bytes=1 << 22,
                    gpu_memory_utilization=0.9, max_num_seqs=8,
                    max_model_len=128, max_num_batched_tokens=64, quantization="none",
                    activation_quantization="none", tokenizer_json="", eos_token_id=None, seed=None,
                    weight_cache_dir="")
    if unknown := set(overrides) - set(defaults):
        raise TypeError(f"worker_config has no field {sorted(unknown)}")
    kw = defaults | overrides
    return WorkerConfig(
        model=model,
        device=DeviceConfig(BackendName(kw["backend"]), kw["device"], DType(kw["dtype"]),
                            DType(kw["kv_cache_dtype"])),
        kv_cache=KVCacheConfig(kw["block_size"], kw["max_num_blocks"], kw["kv_cache_bytes"],
                               kw["gpu_memory_utilization"]),
        limits=StepLimits(kw["max_num_seqs"], kw["max_model_len"], kw["max_num_batched_tokens"]),
        quant=QuantConfig(Quantization(kw["quantization"]),
                          ActivationQuantization(kw["activation_quantization"])),
        grammar=GrammarConfig(kw["tokenizer_json"], kw["eos_token_id"]),
        seed=kw["seed"],
        weight_cache_dir=str(kw["weight_cache_dir"]),
    )


class Driver:
    """Plays the scheduler: hands out blocks, keeps each sequence's tokens, builds plans."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.next_block = 0
        self.step_id = 0
        self.tokens: dict[int, list[int]] = {}  # every known token of each sequence
        self.blocks: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}  # tokens whose KV is in the cache

    def alloc(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def add(
        self,
        seq_id: int,
        prompt: list[int],
        chunk: int,
        params: SamplingParams | None = None,
        shared_blocks: Sequence[int] = (),
    ) -> ScheduledSeq:
        """First chunk of a new sequence; `shared_blocks` are prefix-cache hits (full blocks)."""
        start = len(shared_blocks) * self.block_size
        self.tokens[seq_id] = list(prompt)
        self.blocks[seq_id] = list(shared_blocks)
        self.computed[seq_id] = start
        s = self._chunk(seq_id, chunk)
        return ScheduledSeq(
            seq_id,
            s.token_ids,
            start,
            self.blocks[seq_id],
            s.sample,
            reset=True,
            prefix_ids=prompt[:start],
            num_prompt_tokens=len(prompt),
            sampling=params or SamplingParams(),
        )

    def next(self, seq_id: int, chunk: int = 1) -> ScheduledSeq:
        """The next chunk (decode when one token is left) of a running sequence."""
        return self._chunk(seq_id, chunk)

    def _chunk(self, seq_id: int, chunk: int) -> ScheduledSeq:
        start, tokens = self.computed[seq_id], self.tokens[seq_id]
        ids = tokens[start : start + chunk]
        end = start + len(ids)
        blocks = self.blocks[seq_id]
        new = self.alloc(max(0, -(-end // self.block_size) - len(blocks)))
        blocks.extend(new)
        self.computed[seq_id] = end
        return ScheduledSeq(seq_id, ids, start, new, sample=end == len(tokens))

    def step(self, seqs: list[ScheduledSeq], finished: Sequence[int] = ()) -> tuple[StepResult, torch.Tensor]:
        plan = StepPlan(self.step_id, seqs, list(finished))
        self.step_id += 1
        result, logits = self.runner.execute_with_logits(plan)
        for seq_id, token in zip(result.seq_ids, result.token_ids, strict=True):
            self.tokens[seq_id].append(token)
        return result, logits


def mixed_batch(d: Driver, prompt: list[int]) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]]]:
    """Three sequences prefilled in chunks beside each other's decode rows, then decoded
    together: each sequence's prompt and the logits of its sampled rows, in order."""
    prompts = {1: prompt[:3], 2: prompt[:11], 3: (prompt * 2)[:17]}
    rows: dict[int, list[torch.Tensor]] = {1: [], 2: [], 3: []}

    def run(seqs: list[ScheduledSeq]) -> None:
        result, logits = d.step(seqs)
        for i, seq_id in enumerate(result.seq_ids):
            rows[seq_id].append(logits[i])

    run([d.add(1, prompts[1], chunk=3), d.add(2, prompts[2], chunk=6)])
    run([d.next(1), d.next(2, 5), d.add(3, prompts[3], chunk=8)])
    run([d.next(2), d.next(3, 9), d.next(1)])
    for _ in range(5):
        run([d.next(3), d.next(1), d.next(2)])
    return prompts, rows


class Oracle:
    """The transformers model the checkpoint came from."""

    def __init__(self, hf: torch.nn.Module) -> None:
        self.hf = hf

    def logits(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] logits of one full forward: row i predicts token i + 1."""
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].float()

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = self.hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
        return out[0, len(prompt) :].tolist()


def write_tiny_gguf(path: Path, name: str = "llama", linear_type: str = "Q4_1") -> Path:
    """A tiny checkpoint as llama.cpp would convert it: linears in Q4_1 (packed to int4 by
    --quantization auto; or `linear_type`, e.g. Q5_0 for int5), the embedding and lm_head in
    Q8_0, norms in F32."""
    import gguf
    from gguf.quants import quantize

    from pypto_serving.loader.gguf_file import _GLOBAL_NAMES, _LAYER_NAMES

    hf = build_hf_model(name)
    a, arch = arch_from_hf_config(hf.config.to_dict()), hf.config.model_type
    writer = gguf.GGUFWriter(path, arch)
    for key, value in (("block_count", a.num_layers), ("context_length", a.max_position_embeddings),
                       ("embedding_length", a.hidden_size), ("feed_forward_length", a.intermediate_size),
                       ("attention.head_count", a.num_heads), ("attention.head_count_kv", a.num_kv_heads),
                       ("vocab_size", a.vocab_size)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", a.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", a.rope_theta)
    names = {hf_name: ours for ours, hf_name in _GLOBAL_NAMES.items()}
    names |= {part: ours for ours, part in _LAYER_NAMES.items()}
    for hf_name, tensor in hf.state_dict().items():
        writer_name, data = _gguf_tensor(hf_name, tensor.numpy(), names, a)
        q = gguf.GGMLQuantizationType
        head = "embd" in writer_name or writer_name.startswith("output.")
        qtype = q.F32 if data.ndim == 1 else q.Q8_0 if head else q[linear_type]
        raw = data if qtype == q.F32 else quantize(data, qtype)
        writer.add_tensor(writer_name, raw, raw_dtype=None if qtype == q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensor(hf_name: str, data: object, names: dict[str, str], arch: ModelArch) -> tuple[str, object]:
    if hf_name in names:
        return names[hf_name], data
    _, _, layer, *part, kind = hf_name.split(".")
    ours = names[".".join(part)]
    heads = {"attn_q": arch.num_heads, "attn_k": arch.num_kv_heads}.get(ours)
    if heads and kind == "weight" and arch.family == "llama":  # llama.cpp's converter permutes Q and K rows
        data = data.reshape(heads, 2, data.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(data.shape)
    return f"blk.{layer}.{ours}.{kind}", data
