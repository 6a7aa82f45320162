"""Which part of the model a tensor-parallel rank holds (Megatron-style, as vLLM splits it).

Column-parallel (output rows split): q/k/v and gate/up; each rank computes its own heads and
its own slice of the MLP's intermediate. Row-parallel (input columns split): o and down; each
rank's partial product is summed over the ranks (all-reduce). KV heads split across the
ranks, or, with fewer KV heads than ranks, each is replicated on `size / kv_heads` ranks.
Vocab-parallel: the embedding and the lm_head hold `ceil(vocab / size)` rows each (the last
rank's padded with zeros); a rank embeds the ids in its range (zeros elsewhere, summed over
the ranks) and computes its slice of the logits (gathered over the ranks). Norms are whole on
every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import msgspec
import torch

from pypto_serving.loader.arch import ModelArch
from pypto_serving.parallel.shapes import check_divisible

Collective = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `size`; `all_reduce`/`all_gather` are the group's collectives (given
    by parallel/group.py; identity for one rank)."""

    rank: int = 0
    size: int = 1
    all_reduce: Collective = field(default=lambda x: x, repr=False, compare=False)
    all_gather: Collective = field(default=lambda x: x, repr=False, compare=False)  # along the last dim

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not one of {self.size} ranks")

    def local_arch(self, arch: ModelArch) -> ModelArch:
        """The shapes one rank's part of the model has."""
        if self.size == 1:
            return arch
        reason = check_divisible(arch, self.size)
        if reason is not None:
            raise ValueError(reason)
        return msgspec.structs.replace(
            arch, num_heads=arch.num_heads // self.size, num_kv_heads=self.kv_heads(arch),
            intermediate_size=arch.intermediate_size // self.size, vocab_size=self.vocab_rows(arch))

    def kv_heads(self, arch: ModelArch) -> int:
        return max(1, arch.num_kv_heads // self.size)

    def first_kv_head(self, arch: ModelArch) -> int:
        if arch.num_kv_heads >= self.size:
            return self.rank * self.kv_heads(arch)
        return self.rank * arch.num_kv_heads // self.size

    def vocab_rows(self, arch: ModelArch) -> int:
        return -(-arch.vocab_size // self.size)

    def shard(self, hf_name: str, tensor: torch.Tensor, arch: ModelArch) -> torch.Tensor:
        """This rank's part of one checkpoint tensor (HF name)."""
        if self.size == 1:
            return tensor
        d = arch.head_dim
        q = arch.num_heads // self.size * d
        if ".self_attn.q_proj." in hf_name:
            return tensor.narrow(0, self.rank * q, q)
        if ".self_attn.k_proj." in hf_name or ".self_attn.v_proj." in hf_name:
            kv = self.kv_heads(arch) * d
            return tensor.narrow(0, self.first_kv_head(arch) * d, kv)
        if ".self_attn.o_proj.weight" in hf_name:
            return tensor.narrow(1, self.rank * q, q)
        inter = arch.intermediate_size // self.size
        if ".mlp.gate_proj." in hf_name or ".mlp.up_proj." in hf_name:
            return tensor.narrow(0, self.rank * inter, inter)
        if ".mlp.down_proj.weight" in hf_name:
            return tensor.narrow(1, self.rank * inter, inter)
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self._vocab_rows(tensor, arch)
        return tensor

    def _vocab_rows(self, tensor: torch.Tensor, arch: ModelArch) -> torch.Tensor:
        rows = self.vocab_rows(arch)
        start = self.rank * rows
        part = tensor[start:start + rows]
        if part.shape[0] == rows:
            return part
        return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])

    def shard_all(self, weights: Iterable[tuple[str, torch.Tensor]],
                  arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield name, self.shard(name, tensor, arch)

    # -- the forward's collectives ---------------------------------------------------
    def embed(self, embed: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
              arch: ModelArch) -> torch.Tensor:
        """The embeddings of `ids`, each from the rank whose vocab rows hold it."""
        if self.size == 1:
            return embed(ids)
        rows = self.vocab_rows(arch)
        local = ids - self.rank * rows
        inside = (local >= 0) & (local < rows)
        h = embed(torch.where(inside, local, 0))
        return self.all_reduce(h * inside.unsqueeze(-1).to(h.dtype))

    def logits(self, local: torch.Tensor, arch: ModelArch) -> torch.Tensor:
        """[N, vocab rows of this rank] -> [N, vocab], the same on every rank."""
        if self.size == 1:
            return local
        return self.all_gather(local.contiguous())[:, :arch.vocab_size]


SINGLE = TensorParallel()
