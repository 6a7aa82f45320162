"""Decode steps replayed from captured CUDA graphs: the cuda backend's whole-stack runner.

At start-up the model's forward is captured once per size of a ladder of batch sizes (1, 2, 4,
... 256, vLLM's, capped by --max-num-seqs). An all-decode step of B sequences is padded to the
smallest size that holds it, its inputs are copied into that graph's static buffers and the
graph is replayed: one launch for the whole stack instead of a few hundred small kernels
dispatched from Python. Prefill and mixed steps, and decode batches above the ladder, run
eagerly (the runner falls back to the model).

The static inputs (`DecodeInputs`): token ids, positions, the slot each row's k/v goes to, each
row's context slots (as wide as --max-model-len, so one graph serves every context length;
the attention reads a row's first `lens` slots only) and context lengths. A padded row writes
its k/v to a scratch slot that no sequence owns (a block past the allocator's), attends to
that one slot, and its hidden state is dropped: rows do not mix in a dense decoder, so the
real rows' outputs are those of the unpadded batch. Capture is injected (`Capture`): the tests
run the same flow with plain calls on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pypto_serving.kernels.attention import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]
LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # vLLM's decode capture sizes
# (input_ids, positions, meta, kv_caches) -> hidden [T, hidden]: the model's forward
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, list[KVCache]], torch.Tensor]
# A zero-argument step -> its replay, which reruns the step on the same buffers and returns
# the same output tensor, overwritten
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


@dataclass(frozen=True, slots=True)
class GraphSpec:
    """What the runner tells the backend about the graphs it may capture."""

    sizes: tuple[int, ...] = ()  # batch sizes, ascending (empty: no graphs)
    width: int = 0  # context slots per row: --max-model-len

    @property
    def rows(self) -> int:
        """The largest graph's batch (0: none)."""
        return self.sizes[-1] if self.sizes else 0


NO_GRAPHS = GraphSpec()


def graph_sizes(max_num_seqs: int, ladder: tuple[int, ...] = LADDER) -> tuple[int, ...]:
    """The ladder's sizes below --max-num-seqs, and it (or the ladder's top) as the last:
    every batch up to that runs a graph."""
    top = min(max_num_seqs, ladder[-1])
    return (*(s for s in ladder if s < top), top)


def padded_size(sizes: tuple[int, ...], batch: int) -> int | None:
    """The smallest size that holds `batch` rows; None where none does (eager)."""
    return next((s for s in sizes if s >= batch), None)


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """A graph's static inputs: rows 0 .. B - 1 are the step's, the rest padding."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64
    ctx_slots: torch.Tensor  # [N, width] int64
    lens: torch.Tensor  # [N] int64
    columns: torch.Tensor  # [width] 0 .. width - 1 (the mask's, made once)

    @staticmethod
    def empty(rows: int, width: int, scratch_slot: int, device: torch.device) -> DecodeInputs:
        """Every row padding: a capture (and its warm-up) writes only the scratch slot."""
        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        inputs = DecodeInputs(ints(rows), ints(rows), ints(rows), ints(rows, width), ints(rows),
                              torch.arange(width, device=device))
        inputs.pad(0, scratch_slot)
        return inputs

    def rows(self, n: int) -> DecodeInputs:
        """The first n rows (views: the graph of size n reads the same memory)."""
        return DecodeInputs(self.input_ids[:n], self.positions[:n], self.slot_mapping[:n],
                            self.ctx_slots[:n], self.lens[:n], self.columns)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             scratch_slot: int) -> None:
        """The step's B rows, then padding up to N. The padding is rewritten every step: a
        smaller batch after a larger one would otherwise write the old rows' slots."""
        b, used = input_ids.shape[0], meta.decode_slots.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.ctx_slots[:b, :used].copy_(meta.decode_slots)  # past `lens`: never read
        self.lens[:b].copy_(meta.decode_lens)
        self.pad(b, scratch_slot)

    def pad(self, first: int, scratch_slot: int) -> None:
        """Rows from `first` on: token 0 at position 0, written to and attending to the scratch
        slot alone (a context of one key: no empty softmax)."""
        self.input_ids[first:].zero_()
        self.positions[first:].zero_()
        self.slot_mapping[first:].fill_(scratch_slot)
        self.ctx_slots[first:, 0].fill_(scratch_slot)
        self.lens[first:].fill_(1)

    def metadata(self) -> AttentionMetadata:
        """An all-decode step's metadata over these buffers (built inside the capture, so the
        mask is recomputed from `lens` at every replay)."""
        mask = self.columns < self.lens.unsqueeze(1)
        rows = torch.arange(self.lens.shape[0], device=self.lens.device)
        return AttentionMetadata(self.slot_mapping, rows, self.ctx_slots, mask[:, None, None, :], (),
                                 all_decode=True, decode_lens=self.lens)


class DecodeGraphs:
    """A `StackRunner` (backends/portable.py): the graphs of every size, and their buffers."""

    def __init__(self, forward: Forward, kv_caches: list[KVCache], spec: GraphSpec, scratch_slot: int,
                 device: torch.device, capture: Capture) -> None:
        """`scratch_slot`: where padded rows write their k/v (no sequence owns it)."""
        self.spec, self.scratch_slot, self._caches = spec, scratch_slot, kv_caches
        self._inputs = DecodeInputs.empty(spec.rows, spec.width, scratch_slot, device)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        for n in sorted(spec.sizes, reverse=True):  # the largest first: its memory serves the rest
            self._replays[n] = capture(self._step_of(forward, self._inputs.rows(n)))

    def _step_of(self, forward: Forward, inputs: DecodeInputs) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            return forward(inputs.input_ids, inputs.positions, inputs.metadata(), self._caches)

        return step

    def applies(self, meta: AttentionMetadata, kv_caches: list[KVCache]) -> bool:
        """All-decode steps of a captured size or less, over the caches the graphs write."""
        return (meta.all_decode and meta.decode_lens is not None and kv_caches is self._caches
                and meta.decode_slots.shape[1] <= self.spec.width
                and padded_size(self.spec.sizes, meta.decode_lens.shape[0]) is not None)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [B] -> the final hidden states [B, hidden] (a view of the
        graph's output: valid until the next replay), or `out_rows`' (every row is computed)."""
        b = input_ids.shape[0]
        n = padded_size(self.spec.sizes, b)
        self._inputs.fill(input_ids, positions, meta, self.scratch_slot)
        hidden = self._replays[n]()[:b]
        return hidden if out_rows is None else hidden[out_rows]


class CudaCapture:
    """`Capture` on a CUDA device: a warm-up run on a side stream (Triton compiles, cuBLAS
    picks its kernels), then the capture; every graph shares one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
