"""Hugging Face tensor names -> our (partly fused) parameters."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pypto_serving.loader.arch import ModelArch
from pypto_serving.models.quant import PackedRows, finish_loading
from pypto_serving.parallel.sharding import SINGLE, TensorParallel

# HF projection -> (our fused module, shard index within its parameter rows).
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    # a mixture of experts' experts (mlp.experts.N.) and shared expert (mlp.shared_expert.)
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# [experts, rows, cols]: transformers 5 (in memory) fuses gate and up, GGUF does not
STACKED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?")


def load_weights(model: nn.Module, arch: ModelArch, weights: Iterable[tuple[str, torch.Tensor]],
                 tp: TensorParallel = SINGLE) -> None:
    """Copy every (HF name, tensor) into `model`, casting (packing quantized weights as they
    come); fail on missing or unknown names. With `tp`, `model` is one rank's part: each
    tensor is cut to that part first."""
    weights = getattr(model, "checkpoint_names", lambda named: named)(weights)  # a family's own names
    weights, arch = tp.shard_all(split_experts(weights), arch), tp.local_arch(arch)
    params: dict[str, nn.Parameter | PackedRows] = dict(model.named_parameters())
    params |= {name: m for name, m in model.named_modules() if isinstance(m, PackedRows)}
    expected = {(name, s) for name in params for s in range(len(shard_rows(name, arch)))}
    for hf_name, tensor in weights:
        if hf_name.endswith(IGNORED_SUFFIXES) or _is_tied_head(hf_name, arch):
            continue
        name, shard = our_name(hf_name)
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
        _copy_shard(params[name], shard_rows(name, arch), shard, tensor, hf_name)
        expected.discard((name, shard))
    if expected:
        missing = sorted({name for name, _ in expected})
        raise ValueError(f"checkpoint lacks tensors for: {', '.join(missing)}")
    finish_loading(model)


def split_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Experts stored as one 3-D tensor per projection (transformers 5 in memory, GGUF's
    *_exps) -> each expert's own tensors, as published checkpoints name them."""
    for name, tensor in weights:
        match = STACKED_EXPERTS.fullmatch(name)
        if match is None or tensor.dim() != 3:
            yield name, tensor
            continue
        stem, kind = match[1], match[2]
        for e, w in enumerate(tensor.unbind(0)):
            if kind == "gate_up_proj":
                gate, up = w.chunk(2, dim=0)
                yield f"{stem}.{e}.gate_proj.weight", gate
                yield f"{stem}.{e}.up_proj.weight", up
            else:
                yield f"{stem}.{e}.{kind}.weight", w


def _is_tied_head(hf_name: str, arch: ModelArch) -> bool:
    # Some tied checkpoints still store lm_head.weight; the embedding is the head.
    return arch.tie_word_embeddings and hf_name == "lm_head.weight"


def our_name(hf_name: str) -> tuple[str, int]:
    """HF name -> (our parameter name, shard index)."""
    for hf_part, (ours, shard) in FUSED.items():
        if f".{hf_part}." in hf_name:
            return hf_name.replace(hf_part, ours), shard
    return hf_name, 0


def shard_rows(name: str, arch: ModelArch) -> list[int]:
    """Rows each checkpoint tensor fills in a parameter; [-1] = the whole parameter."""
    if ".qkv_proj." in name:
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        return [q, kv, kv]
    if ".experts." in name and ".gate_up_proj." in name:
        return [arch.moe_intermediate_size] * 2
    if ".shared_expert." in name and ".gate_up_proj." in name:
        return [arch.shared_expert_intermediate_size] * 2
    if ".gate_up_proj." in name:
        return [arch.intermediate_size] * 2
    return [-1]


def _copy_shard(
    param: nn.Parameter | PackedRows, rows: list[int], shard: int, tensor: torch.Tensor, hf_name: str
) -> None:
    if isinstance(param, PackedRows):
        _pack_shard(param, rows, shard, tensor, hf_name)
        return
    target = param.data
    if rows != [-1]:
        target = target.narrow(0, sum(rows[:shard]), rows[shard])
    if target.shape != tensor.shape:
        raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


def _pack_shard(weight: PackedRows, rows: list[int], shard: int, tensor: torch.Tensor, hf_name: str) -> None:
    n = weight.n if rows == [-1] else rows[shard]
    if tensor.shape != (n, weight.k):
        raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)}, expected {(n, weight.k)}")
    weight.load_rows(sum(rows[:shard]) if rows != [-1] else 0, tensor)
