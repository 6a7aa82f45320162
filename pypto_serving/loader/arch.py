"""The shape of a model, as the device worker needs it to build the network.

Built from a Hugging Face `config.json` (loader/hf.py) or from GGUF metadata
(loader/gguf_file.py); sent to the device worker inside `WorkerConfig`.
"""

from __future__ import annotations

import msgspec

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3_moe")


class RopeScaling(msgspec.Struct, frozen=True):
    """Llama-3 style frequency scaling; `kind` is "llama3" or "linear"."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelArch(msgspec.Struct, frozen=True):
    family: str  # one of FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    rope_scaling: RopeScaling | None = None  # of the global layers, with sliding ones
    # Gemma 3 (the defaults are every other family's):
    sliding_layers: tuple[bool, ...] = ()  # per layer: attends to a sliding window only
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included
    rope_local_theta: float = 0.0  # the sliding layers' rotary base (unscaled)
    query_pre_attn_scalar: float = 0.0  # attention scale = this ** -0.5; 0: head_dim
    final_logit_softcapping: float = 0.0  # logits = cap * tanh(logits / cap); 0: none

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int:
        """The sliding window of layer `layer`; 0: it attends to the whole context."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else 0
    # Mixture of experts (models/moe.py); num_experts 0: every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # the top-k routing weights are renormalized to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts (the rest: dense)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one)

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index in self.moe_layers
