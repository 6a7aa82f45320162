"""Weight-only quantized layers: linears and embeddings whose weights are packed as they load.

`--quantization`: "none" keeps nn.Linear / nn.Embedding in the model dtype (exact path);
"int8" packs every weight to int8; "int4" packs decoder linears to int4 and embeddings /
lm_head to int8; "auto" packs a linear to int4 where its weights already sit on a 4-bit grid
(GGUF Q4_0 / Q4_1: lossless), else to int5 where they sit on a 5-bit one (Q5_0: lossless),
otherwise to int8. The backend (backends/) supplies the packing
and the kernels that read it (`QuantKernels`): the CPU's C kernels, or the portable
dequantize-then-F.linear ones.

`--activation-quantization int8` makes the C matmuls (all but the lm_head's, which takes
int16 ones) quantize their input rows to int8 per group of 32 first, as llama.cpp does
(`int16`: two int8 planes, the second holding each rounding's residual: near exact, at twice
the integer multiply-adds; `mixed`, the CPU default with packed weights: int8, plus that
second plane for the groups of a row whose int8 step is an outlier's, where most of int8's
error lies): about twice the multiply-adds per second on 4-bit weights, at the price of a
small, batch-independent error (each row is quantized on its own, so a request's tokens do
not depend on its batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from pypto_serving.kernels import quant_linear as portable
from pypto_serving.kernels.decoder_ops import PORTABLE, DecoderOps
from pypto_serving.kernels.quant_linear import PackedWeight, can_pack, probe_rows

QUANTIZATIONS = ("none", "int8", "int4", "auto")
ACTIVATION_QUANTIZATIONS = ("none", "int8", "int16", "mixed")
# A weight within 2% of a level's step counts as on the 4-bit grid: what the fp16 scale and
# zero cost a Q4_K sub-block (its scale is fp16 x 6 bits); packing it to int8 instead would move
# weights by up to 15 / 254 / 2 = 3% of that step, in twice the bytes. The same bound decides
# int5 (Q5_0 grids pack to it exactly).
LOSSLESS_STEP_FRACTION = 0.02
AUTO_BITS = (4, 5)  # tried in this order; a weight on neither grid packs to int8

Pack = Callable[[torch.Tensor, int], tuple[PackedWeight, float]]  # (w, bits) -> (packed, error)
Matmul = Callable[[torch.Tensor, PackedWeight, torch.Tensor | None], torch.Tensor]
Gather = Callable[[torch.Tensor, PackedWeight], torch.Tensor]


@dataclass(frozen=True, slots=True)
class QuantKernels:
    """A backend's packed-weight layout and the kernels that read it."""

    pack: Pack
    matmul: Matmul
    gather: Gather
    activations: str = "none"  # what `matmul` quantizes its inputs to: none, int8, int16
    # The lm_head's matmul (None: `matmul`). Its errors go straight into the logits, so the
    # CPU's does not take `matmul`'s int8 activations: float ones without activation
    # quantization, else ~15-bit ones (int16 per group of 32, exact integer dots), which
    # read its int8 panels at the speed of memory where float activations are bound by
    # converting the levels (qhead.c).
    head: Matmul | None = None
    # Each row's argmax of `head`'s logits, first index on ties, found without most of them
    # (None: not here; the call's None: not for these rows or this weight)
    head_argmax: Callable[[torch.Tensor, PackedWeight], torch.Tensor | None] | None = None

    @property
    def head_matmul(self) -> Matmul:
        return self.head or self.matmul


PORTABLE_KERNELS = QuantKernels(portable.pack, portable.quant_linear, portable.quant_embedding)


class PackedRows(nn.Module):
    """A weight [n, k] that arrives in row shards and is packed once every row is in. With
    bits None, each of the 4- and 5-bit attempts packs the probe rows first (`probe_rows`):
    most GGUF types fail there (Q5_0 the 4-bit one; Q8_0, Q6_K both) and go on without a
    whole pack at that width."""

    def __init__(self, n: int, k: int, bits: int | None, pack: Pack) -> None:
        super().__init__()
        self.n, self.k, self.bits = n, k, bits  # bits None: 4 or 5 if lossless, else 8
        self._pack_weight = pack
        self.packed: PackedWeight | None = None
        self._staged: dict[int, torch.Tensor] = {}
        self.device = torch.device("cpu")  # where the packed tensors go (build_model sets it)

    def load_rows(self, start: int, rows: torch.Tensor) -> None:
        if rows.shape[1] != self.k or start + rows.shape[0] > self.n:
            raise ValueError(f"rows {start}..{start + rows.shape[0]} of width {rows.shape[1]} do not fit "
                             f"a [{self.n}, {self.k}] weight")
        self._staged[start] = rows.float()
        if sum(t.shape[0] for t in self._staged.values()) == self.n:
            self._pack(torch.cat([self._staged[s] for s in sorted(self._staged)]))
            self._staged = {}

    def _pack(self, w: torch.Tensor) -> None:
        if self.bits:
            self.use_packed(self._pack_weight(w, self.bits)[0])
            return
        probe = probe_rows(w)
        for bits in AUTO_BITS:
            if self._pack_weight(probe, bits)[1] <= LOSSLESS_STEP_FRACTION:
                packed, error = self._pack_weight(w, bits)
                if error <= LOSSLESS_STEP_FRACTION:
                    self.use_packed(packed)
                    return
        self.use_packed(self._pack_weight(w, 8)[0])

    @property
    def allowed_bits(self) -> tuple[int, ...]:
        return (self.bits,) if self.bits else (*AUTO_BITS, 8)

    def use_packed(self, packed: PackedWeight) -> None:
        """Takes a weight packed earlier (the weight cache's) as this one's."""
        if (packed.n, packed.k) != (self.n, self.k) or packed.bits not in self.allowed_bits:
            raise ValueError(f"a packed [{packed.n}, {packed.k}] int{packed.bits} weight does not fit "
                             f"a [{self.n}, {self.k}] int{'/int'.join(map(str, self.allowed_bits))} one")
        if packed.q.device != self.device:  # packed on the host (or mapped from the cache)
            packed = replace(packed, **{name: getattr(packed, name).to(self.device)
                                       for name in ("q", "scale", "zero")})
        self.packed, self._staged = packed, {}
        for name in ("q", "scale", "zero"):  # buffers, so weight-size accounting sees them
            self.register_buffer(name, getattr(packed, name), persistent=False)

    def check_loaded(self, name: str) -> None:
        if self.packed is None:
            raise ValueError(f"checkpoint lacks rows of {name}")


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int | None,
                 kernels: QuantKernels, head: bool = False) -> None:
        super().__init__()
        self.weight = PackedRows(out_features, in_features, bits, kernels.pack)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.kernels = kernels
        self._matmul = kernels.head_matmul if head else kernels.matmul
        self._argmax = kernels.head_argmax if head and not bias else None
        self._panel_bias: torch.Tensor | None = None

    def finish_loading(self) -> None:
        """Bias padded to whole panels, as the kernel reads it."""
        if self.bias is not None:
            pad = self.weight.packed.q.shape[0] * 16 - self.bias.shape[0]
            self._panel_bias = torch.nn.functional.pad(self.bias.detach().float(), (0, pad))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.weight.packed, self._panel_bias)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """An lm_head's `forward(x).argmax(-1)` where its kernels find it faster; else None."""
        return self._argmax(x, self.weight.packed) if self._argmax is not None else None


class QuantEmbedding(nn.Module):
    """An embedding table packed like a linear's weight; `as_linear` is the tied lm_head."""

    def __init__(self, num_embeddings: int, dim: int, kernels: QuantKernels) -> None:
        super().__init__()
        self.weight = PackedRows(num_embeddings, dim, 8, kernels.pack)
        self.kernels = kernels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.gather(ids, self.weight.packed)

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.head_matmul(x, self.weight.packed, None)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """`as_linear(x).argmax(-1)` where the kernels find it faster; else None."""
        argmax = self.kernels.head_argmax
        return argmax(x, self.weight.packed) if argmax is not None else None


@dataclass(frozen=True, slots=True)
class LayerFactory:
    """Builds the model's linears and embedding for one quantization setting, with the
    kernels a backend chose (`Backend.layers`; default: the portable ones)."""

    quantization: str = "none"
    kernels: QuantKernels = PORTABLE_KERNELS
    ops: DecoderOps = PORTABLE
    # The last decoder layer's linears' kernels, where they differ (None: `kernels`). Its
    # rounding errors reach the logits through no later layer, and it is the layer whose
    # activations' rounding moves them most (backends/cpu.py gives it int16 activations
    # under mixed ones; docs/performance.md, "Accuracy of the fast path").
    last_layer: QuantKernels | None = None

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; expected one of {QUANTIZATIONS}")

    def linear(self, in_features: int, out_features: int, bias: bool = False,
               head: bool = False) -> nn.Module:
        if self.quantization == "none" or not can_pack(out_features, in_features):
            return nn.Linear(in_features, out_features, bias=bias)
        bits = {"int8": 8, "int4": 4, "auto": None}[self.quantization]
        return QuantLinear(in_features, out_features, bias, 8 if head else bits, self.kernels, head)

    def for_layer(self, index: int, layers: int) -> LayerFactory:
        """The factory of decoder layer `index` of `layers`."""
        if self.last_layer is None or index != layers - 1:
            return self
        return replace(self, kernels=self.last_layer, last_layer=None)

    def decoder_ops(self) -> DecoderOps:
        return self.ops

    def embedding(self, num_embeddings: int, dim: int) -> nn.Module:
        if self.quantization == "none" or not can_pack(num_embeddings, dim):
            return nn.Embedding(num_embeddings, dim)
        return QuantEmbedding(num_embeddings, dim, self.kernels)


def finish_loading(model: nn.Module) -> None:
    """Every packed weight is complete; biases are laid out for the kernels; then every
    module with a `finish_loading` of its own (an MoE layer's experts) sees its finished
    linears (children come before their parents here)."""
    modules = list(model.named_modules())
    for name, module in modules:
        if isinstance(module, PackedRows):
            module.check_loaded(name)
    for _, module in reversed(modules):
        if hasattr(module, "finish_loading"):
            module.finish_loading()
