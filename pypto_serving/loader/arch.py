"""The shape of a model, as the device worker needs it to build the network.

Built from a Hugging Face `config.json` (loader/hf.py) or from GGUF metadata
(loader/gguf_file.py); sent to the device worker inside `WorkerConfig`.
"""

from __future__ import annotations

import msgspec

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "deepseek_v4")


class RopeScaling(msgspec.Struct, frozen=True):
    """Frequency scaling; `kind` is "llama3", "linear" or "yarn" (YaRN's ramp between
    `beta_fast` and `beta_slow` rotations; its cos/sin are not rescaled)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    fast_rotations: float = 32.0  # YaRN's beta_fast
    slow_rotations: float = 1.0  # beta_slow


class DeepseekV4Shape(msgspec.Struct, frozen=True):
    """What DeepSeek V4 adds to a decoder's shape (models/deepseek_v4.py)."""

    q_lora_rank: int  # the query's low-rank bottleneck
    o_groups: int  # head groups of the grouped output projection
    o_lora_rank: int  # each group's width after its projection
    rope_dim: int  # the trailing channels of a head that rotate (interleaved pairs)
    # per layer: "sliding", "csa" (compressed sparse) or "hca" (heavily compressed)
    attention: tuple[str, ...]
    csa_rate: int  # tokens per compressed entry of a csa layer
    hca_rate: int  # of an hca layer
    compress_rope_theta: float  # the rotary base of csa/hca layers and their compressed entries
    compress_rope_scaling: RopeScaling | None
    hc_mult: int  # residual streams of the hyper-connections
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[int, ...]  # layers whose experts are picked by token id, not by score
    swiglu_limit: float  # the experts' gate and up clamp
    index_heads: int  # the lightning indexer's query heads
    index_head_dim: int
    index_topk: int  # compressed entries a csa query attends to
    scoring: str  # the router's score: sqrtsoftplus, sigmoid or softmax
    routed_scaling_factor: float

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of layer `layer`; 0: it keeps no compressed entries."""
        kind = self.attention[layer]
        return self.csa_rate if kind == "csa" else self.hca_rate if kind == "hca" else 0


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
    deepseek_v4: DeepseekV4Shape | None = None

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index in self.moe_layers
