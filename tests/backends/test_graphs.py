"""Decode graphs without a GPU: which sizes are captured, which size a batch pads to, and the
static inputs a replay reads (padded rows harmless, stale rows rewritten)."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.backends.graphs import LADDER, DecodeInputs, graph_sizes, padded_size
from pypto_serving.kernels.attention import AttentionMetadata

SCRATCH = 999


@pytest.mark.parametrize(("max_num_seqs", "sizes"), [
    (1, (1,)), (2, (1, 2)), (16, (1, 2, 4, 8, 16)),
    (24, (1, 2, 4, 8, 16, 24)),  # the top rung is --max-num-seqs: every batch has a graph
    (256, LADDER), (1000, LADDER),  # vLLM's ladder stops at 256: bigger batches run eagerly
])
def test_the_ladder_is_capped_by_max_num_seqs(max_num_seqs: int, sizes: tuple[int, ...]) -> None:
    assert graph_sizes(max_num_seqs) == sizes


def test_a_batch_pads_to_the_smallest_size_that_holds_it() -> None:
    sizes = graph_sizes(24)
    assert [padded_size(sizes, b) for b in (1, 2, 3, 4, 5, 9, 16, 17, 24)] == [1, 2, 4, 4, 8, 16, 16, 24, 24]
    assert padded_size(sizes, 25) is None  # eager
    assert padded_size((), 1) is None  # no graphs at all


def decode_meta(slots: list[list[int]], lens: list[int]) -> AttentionMetadata:
    ctx = torch.tensor(slots)
    lens_t = torch.tensor(lens)
    mask = torch.arange(ctx.shape[1]) < lens_t.unsqueeze(1)
    last = ctx.gather(1, (lens_t - 1).unsqueeze(1)).squeeze(1)
    return AttentionMetadata(last, torch.arange(len(lens)), ctx, mask[:, None, None, :], (), True, lens_t)


def test_padded_rows_write_and_read_only_the_scratch_slot() -> None:
    inputs = DecodeInputs.empty(4, 8, SCRATCH, torch.device("cpu"))
    assert inputs.slot_mapping.tolist() == [SCRATCH] * 4 and inputs.lens.tolist() == [1] * 4
    meta = decode_meta([[10, 11, 12], [20, 21, 22]], [3, 2])
    inputs.fill(torch.tensor([7, 8]), torch.tensor([2, 1]), meta, SCRATCH)
    assert inputs.input_ids.tolist() == [7, 8, 0, 0]
    assert inputs.positions.tolist() == [2, 1, 0, 0]
    assert inputs.slot_mapping.tolist() == [12, 21, SCRATCH, SCRATCH]
    assert inputs.lens.tolist() == [3, 2, 1, 1]
    assert inputs.ctx_slots[:, 0].tolist() == [10, 20, SCRATCH, SCRATCH]
    seen = inputs.metadata()
    assert seen.all_decode and seen.decode_mask.shape == (4, 1, 1, 8)
    assert seen.decode_mask[:, 0, 0].sum(dim=1).tolist() == [3, 2, 1, 1]  # each row sees its lens


def test_a_smaller_batch_after_a_larger_one_leaves_no_stale_row() -> None:
    """The old rows' slots would otherwise get the padding's k/v written over them."""
    inputs = DecodeInputs.empty(4, 8, SCRATCH, torch.device("cpu"))
    inputs.fill(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]), decode_meta([[1], [2], [3]], [1, 1, 1]),
                SCRATCH)
    inputs.fill(torch.tensor([4]), torch.tensor([5]), decode_meta([[40, 41, 42, 43, 44, 45]], [6]), SCRATCH)
    assert inputs.slot_mapping.tolist() == [45, SCRATCH, SCRATCH, SCRATCH]
    assert inputs.lens.tolist() == [6, 1, 1, 1] and inputs.input_ids.tolist() == [4, 0, 0, 0]
    half = inputs.rows(2)  # a smaller graph's views of the same buffers
    assert half.lens.data_ptr() == inputs.lens.data_ptr() and half.lens.tolist() == [6, 1]
