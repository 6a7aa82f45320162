"""prepare: one StepPlan's sequences -> flattened input tensors + attention metadata.

Built once per step; every layer reuses it. Host lists go to the device in a handful of
transfers: the slots the step's tokens are written to are computed on the host (a list
comprehension costs less than the ~8 small tensor ops it replaced), the decode rows' context
slots on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pypto_serving.kernels.attention import AttentionMetadata, BlockTables, PrefillSegment
from pypto_serving.kernels.paged_kv import context_slots, token_slots
from pypto_serving.messages.worker import ScheduledSeq
from pypto_serving.worker.seq_state import SeqState


@dataclass(frozen=True, slots=True)
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [S] row of each sampled sequence's last token (with proposals:
    sample_seq_ids: list[int]  # of its last 1 + num_draft tokens, each sequence once per row)


def prepare(
    seqs: list[ScheduledSeq], states: list[SeqState], block_size: int, device: torch.device,
    block_tables: bool = False,
) -> StepBatch:
    """`states[i]` is `seqs[i]`'s state, already updated for this step; `block_tables`: the
    metadata also carries the context as block tables (the backend's kernels read them)."""
    q_lens = [len(s.token_ids) for s in seqs]
    starts = _cumsum(q_lens)
    ctx_lens = [s.start_pos + n for s, n in zip(seqs, q_lens, strict=True)]
    padded = _pad_tables(states, ctx_lens, block_size)
    tables = _ints(padded, device)  # [B, max blocks]
    spans = [range(s.start_pos, n) for s, n in zip(seqs, ctx_lens, strict=True)]
    positions = _ints([p for span in spans for p in span], device)
    slot_mapping = _ints(token_slots(padded, spans, block_size), device)
    sampled = [(i, row) for i, s in enumerate(seqs) if s.sample
               for row in range(starts[i] + q_lens[i] - 1 - s.num_draft, starts[i] + q_lens[i])]
    return StepBatch(
        input_ids=_ints([t for s in seqs for t in s.token_ids], device),
        positions=positions,
        attn=_attention_metadata(seqs, slot_mapping, tables, starts, block_size, block_tables),
        sample_rows=_ints([row for _, row in sampled], device),
        sample_seq_ids=[seqs[i].seq_id for i, _ in sampled],
    )


def _attention_metadata(
    seqs: list[ScheduledSeq],
    slot_mapping: torch.Tensor,
    tables: torch.Tensor,
    starts: list[int],
    block_size: int,
    block_tables: bool = False,
) -> AttentionMetadata:
    single = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
    ctx_lens = [s.start_pos + len(s.token_ids) for s in seqs]
    *decode, lens = _decode_group(tables, single, starts, ctx_lens, block_size)
    prefills = tuple(
        PrefillSegment(
            start=starts[i],
            end=starts[i] + len(s.token_ids),
            ctx_slots=context_slots(tables[i : i + 1], block_size, ctx_lens[i])[0],
        )
        for i, s in enumerate(seqs)
        if len(s.token_ids) > 1
    )
    paged = _block_tables(tables, single, ctx_lens, block_size) if block_tables else None
    return AttentionMetadata(slot_mapping, *decode, prefills, all_decode=len(single) == len(seqs),
                             decode_lens=lens, tables=paged)


def _block_tables(tables: torch.Tensor, single: list[int], ctx_lens: list[int],
                  block_size: int) -> BlockTables:
    """The decode rows' tables and each prefill segment's, int32 as the fused kernels take them."""
    index = torch.tensor(single, device=tables.device)
    decode = tables[index].int() if single else None
    singles = set(single)
    prefills = tuple(tables[i : i + 1, : -(-n // block_size)].int()
                     for i, n in enumerate(ctx_lens) if i not in singles)
    return BlockTables(decode, tuple(ctx_lens[i] for i in single), prefills)


def _decode_group(
    block_tables: torch.Tensor,
    single: list[int],
    starts: list[int],
    ctx_lens: list[int],
    block_size: int,
) -> tuple[torch.Tensor | None, ...]:
    """(rows, slots [Bd, L], mask [Bd, 1, 1, L], lens [Bd]) of the single-query sequences,
    or Nones."""
    if not single:
        return None, None, None, None
    device = block_tables.device
    lens = torch.tensor([ctx_lens[i] for i in single], device=device)
    longest = max(ctx_lens[i] for i in single)
    every = len(single) == len(ctx_lens)  # every row, in order: no gather
    tables = block_tables if every else block_tables[torch.tensor(single, device=device)]
    slots = context_slots(tables, block_size, longest)
    mask = torch.arange(longest, device=device) < lens.unsqueeze(1)
    rows = torch.tensor([starts[i] for i in single], device=device)
    return rows, slots, mask[:, None, None, :], lens


def _pad_tables(states: list[SeqState], ctx_lens: list[int], block_size: int) -> list[list[int]]:
    """Block tables cut to the blocks this step touches, padded with block 0 (masked out)."""
    needed = [-(-n // block_size) for n in ctx_lens]
    width = max(needed)
    for state, n in zip(states, needed, strict=True):
        if len(state.block_table) < n:
            raise ValueError(f"block table has {len(state.block_table)} blocks, step needs {n}")
    return [st.block_table[:n] + [0] * (width - n) for st, n in zip(states, needed, strict=True)]


def _cumsum(lens: list[int]) -> list[int]:
    """Start offset of each sequence's tokens in the flattened batch."""
    starts, total = [], 0
    for n in lens:
        starts.append(total)
        total += n
    return starts


def _ints(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
