"""A step's whole decoder stack as one C call (kernels/cpu/stack.c): the cpu backend's runner.

At batch 1 a SmolLM2 decode step is ~120 packed matmuls and ~150 small fused kernels; called
one by one from Python, their dispatch took about as long as their arithmetic, and a 512-token
prefill step spent ~28 ms (6%) outside the kernels, in that dispatch and in the copies of q
and of the attention output. `DecoderStack` describes every layer's weights and KV cache to
the C side once (ctypes structs holding raw pointers; the model and the caches keep the
tensors alive), then runs each step, decode rows and prefill chunks in any mix, in one call.
The kernels and their order are those of the per-layer path, so the hidden states are the
same bit for bit (tests/worker check it).
Used only where that path would use the same fused kernels: the Llama layer or Gemma 3's (its
(1 + w) norms, post-norms, GeGLU, query scale, sliding windows and their own rotary table), no
experts (MoE), packed weights whose widths fill whole panels, head_dim a multiple of 16 up
to the C attention's MAX_HEAD_DIM (Qwen3's q/k norms run inside the fused projection, as in
that path). With int8 activations
(`--activation-quantization`) the stack's linears are qdot.c's, as in that path.
"""

from __future__ import annotations

import ctypes

import torch

from pypto_serving.kernels.attention import AttentionMetadata
from pypto_serving.kernels.cpu.decoder import MAX_HEAD_DIM
from pypto_serving.kernels.cpu.qlinear import ACTIVATION_PLANES, weight_args  # each layer's planes
from pypto_serving.kernels.quant_linear import PANEL
from pypto_serving.models.gemma3 import Gemma3ForCausalLM
from pypto_serving.models.llama import CausalLM, LlamaForCausalLM
from pypto_serving.models.quant import QuantEmbedding, QuantLinear

KVCache = tuple[torch.Tensor, torch.Tensor]
_P, _I = ctypes.c_void_p, ctypes.c_int64



class _QLinear(ctypes.Structure):
    _fields_ = [("q", _P), ("scale", _P), ("zero", _P), ("bias", _P), ("k", _I), ("n_blocks", _I),
                ("bits", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
                ("pre_ff_norm", _P), ("post_ff_norm", _P), ("qkv", _QLinear), ("o", _QLinear),
                ("gate_up", _QLinear), ("down", _QLinear), ("k_cache", _P), ("v_cache", _P),
                ("window", _I), ("planes", _I)]


class _Chunk(ctypes.Structure):
    _fields_ = [("start", _I), ("n", _I), ("ctx_slots", _P), ("n_ctx", _I)]


class _StepRows(ctypes.Structure):
    _fields_ = [("t", _I), ("slots", _P), ("n_decode", _I), ("decode_rows", _P), ("ctx_slots", _P),
                ("lens", _P), ("max_len", _I), ("n_chunks", _I), ("chunks", ctypes.POINTER(_Chunk)),
                ("n_out", _I), ("out_rows", _P)]


class _Shape(ctypes.Structure):
    _fields_ = [("layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("intermediate", _I), ("kv_half", _I), ("gemma", _I),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("final_norm", _P),
                ("embed_q", _P), ("embed_scale", _P), ("embed_zero", _P), ("embed_bits", _I), ("vocab", _I),
                ("embed_mul", ctypes.c_float), ("rope", _P), ("rope_local", _P), ("positions", _I)]


# A struct's sizeof and each field's (offset, size), in declaration order
Layout = tuple[int, list[tuple[int, int]]]
Mirrors = list[tuple[str, type[ctypes.Structure]]]
# The structs above by their names in stack.c, in the order of its `stack_layout`
MIRRORED: Mirrors = [
    ("QLinear", _QLinear), ("Layer", _Layer), ("Chunk", _Chunk), ("StepRows", _StepRows), ("Shape", _Shape)]


def _c_layouts(lib: ctypes.CDLL) -> list[Layout]:
    """stack.c's own layouts: `stack_layout` gives per struct its sizeof, then each field's offset
    and size, then -1."""
    values = (ctypes.c_int64 * lib.stack_layout(None, 0))()
    lib.stack_layout(values, len(values))
    layouts, it = [], iter(values)
    for size in it:
        fields = []
        while (offset := next(it)) != -1:
            fields.append((offset, next(it)))
        layouts.append((size, fields))
    return layouts


def _ctypes_layout(cls: type[ctypes.Structure]) -> Layout:
    """The layout ctypes gives the struct, as `_c_layouts` gives stack.c's."""
    fields = [getattr(cls, name) for name, *_ in cls._fields_]
    return ctypes.sizeof(cls), [(f.offset, f.size) for f in fields]


def _layout_mismatches(c_layouts: list[Layout], mirrored: Mirrors) -> list[str]:
    """Where the ctypes structs differ from stack.c's, by struct and field. Fields pair up by
    position, as step_stack reads them; a missing or extra field also shows as a count."""
    if len(c_layouts) != len(mirrored):
        return [f"stack.c describes {len(c_layouts)} structs, cpu_stack.py mirrors {len(mirrored)}"]
    problems = []
    for (c_name, cls), (c_size, c_fields) in zip(mirrored, c_layouts, strict=True):
        size, fields = _ctypes_layout(cls)
        if size != c_size:
            problems.append(f"{c_name}: sizeof is {c_size} in stack.c, {size} in {cls.__name__}")
        if len(fields) != len(c_fields):
            problems.append(f"{c_name}: {len(c_fields)} fields in stack.c, {len(fields)} in {cls.__name__}")
        names = [name for name, *_ in cls._fields_]
        for name, field, c_field in zip(names, fields, c_fields, strict=False):
            if field != c_field:
                problems.append(f"{c_name}.{name}: offset {c_field[0]} size {c_field[1]} in stack.c, "
                                f"offset {field[0]} size {field[1]} in {cls.__name__}")
    return problems


def check_layout(lib: ctypes.CDLL, mirrored: Mirrors | None = None) -> None:
    """Raises RuntimeError where the ctypes structs (`MIRRORED` by default) do not match
    stack.c's: step_stack would read the wrong fields (pointers among them) rather than fail."""
    problems = _layout_mismatches(_c_layouts(lib), MIRRORED if mirrored is None else mirrored)
    if problems:
        raise RuntimeError("the ctypes structs of backends/cpu_stack.py do not match kernels/cpu/stack.c "
                           "(change both together): " + "; ".join(problems))


def _qlinear(m: torch.nn.Module, planes: int) -> _QLinear:
    """With quantized activations (planes > 0) no zeros on a symmetric grid: qdot.c computes them."""
    w = m.weight.packed
    bias = m._panel_bias
    zero = weight_args(w, quantized=planes > 0)[4].value
    return _QLinear(w.q.data_ptr(), w.scale.data_ptr(), zero,
                    None if bias is None else bias.data_ptr(), w.k, w.q.shape[0], w.bits)


def _qk_norms(attn: torch.nn.Module) -> tuple[int | None, int | None]:
    if not attn.qk_norm:
        return None, None
    return attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()


def _layer(layer: torch.nn.Module, kv: KVCache, gemma: bool) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    ff_norms = (layer.pre_feedforward_layernorm.weight.data_ptr(),
                layer.post_feedforward_layernorm.weight.data_ptr()) if gemma else (None, None)
    window, planes = layer.window if gemma else 0, ACTIVATION_PLANES[attn.qkv_proj.kernels.activations]
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                  *_qk_norms(attn), *ff_norms, *(_qlinear(m, planes) for m in linears),
                  kv[0].data_ptr(), kv[1].data_ptr(), window, planes)


def _embedding(model: CausalLM) -> tuple:
    """The Shape's embedding fields: the packed table, its rows, and for Gemma 3 the float32
    sqrt(hidden) its embed_inputs multiplies by."""
    embed = model.model.embed_tokens
    w = embed.weight.packed
    mul = float(torch.tensor(model.arch.hidden_size**0.5)) if isinstance(model, Gemma3ForCausalLM) else 0.0
    return w.q.data_ptr(), w.scale.data_ptr(), w.zero.data_ptr(), w.bits, embed.weight.n, mul


def _rope_tables(model: CausalLM) -> list[torch.Tensor]:
    """The rotary tables the stack reads: the model's, then the sliding-window layers' own
    (Gemma 3's) where some layer has a window."""
    windows = isinstance(model, Gemma3ForCausalLM) and any(layer.window for layer in model.model.layers)
    return [model.rope, model.rope_local] if windows else [model.rope]


def _rope_table_fits(table: torch.Tensor, head_dim: int) -> bool:
    return table.dtype == torch.float32 and table.is_contiguous() and table.shape[1:] == (2, head_dim // 2)


def _fills_panels(m: torch.nn.Module) -> bool:
    return isinstance(m, QuantLinear) and m.weight.packed.n % PANEL == 0


class DecoderStack:
    def __init__(self, model: CausalLM, kv_caches: list[KVCache]):
        from pypto_serving.kernels.cpu import library

        self._lib = library()
        check_layout(self._lib)  # cheap (two short C calls), and a DecoderStack is built once per model
        self._model = model
        arch = model.arch
        layers = model.model.layers
        self._gemma = isinstance(model, Gemma3ForCausalLM)
        self._kv_half = kv_caches[0][0].dtype == torch.float16
        self._layers = (_Layer * len(layers))(*(
            _layer(layer, kv, self._gemma) for layer, kv in zip(layers, kv_caches, strict=True)))
        self._rope = _rope_tables(model)
        rope, *local = (table.data_ptr() for table in self._rope)
        self._shape = _Shape(arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads,
                             arch.head_dim, arch.intermediate_size, int(self._kv_half), int(self._gemma),
                             layers[0].input_layernorm.eps, layers[0].self_attn.scale,
                             model.model.norm.weight.data_ptr(), *_embedding(model), rope,
                             local[0] if local else None, model.rope.shape[0])
        self._caches = kv_caches  # kept alive, as the rotary tables: the structs point into them

    @staticmethod
    def build(model: CausalLM, kv_caches: list[KVCache]) -> DecoderStack | None:
        """The stack when the model and caches fit it and the C kernels run here, else None."""
        from pypto_serving.kernels import cpu

        arch = model.arch
        if arch.num_experts:  # stack.c knows dense MLPs only
            return None
        layer_linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                          layer.mlp.down_proj) for layer in model.model.layers]
        linears = [m for four in layer_linears for m in four]
        fits = (
            isinstance(model, (LlamaForCausalLM, Gemma3ForCausalLM))  # the layers stack.c runs
            and cpu.available() and all(_rope_table_fits(t, arch.head_dim) for t in _rope_tables(model))
            and arch.head_dim <= MAX_HEAD_DIM and arch.head_dim % 16 == 0
            and arch.hidden_size % 8 == 0 and arch.intermediate_size % 8 == 0
            and isinstance(model.model.embed_tokens, QuantEmbedding)
            and all(_fills_panels(m) for m in linears)
            and all(len({m.kernels.activations for m in four}) == 1 for four in layer_linears)
            and all(k.dtype == v.dtype and k.dtype in (torch.float16, torch.float32)
                    and k.is_contiguous() and v.is_contiguous() for k, v in kv_caches)
        )
        return DecoderStack(model, kv_caches) if fits else None

    def applies(self, meta: AttentionMetadata, kv_caches: list[KVCache]) -> bool:
        """Decode rows come with their context lengths (the C attention's input)."""
        return (meta.decode_rows is None or meta.decode_lens is not None) and kv_caches is self._caches

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden], or with `out_rows`
        (ascending int64 rows) those rows' only, [len(out_rows), hidden]: the last layer then
        runs past its k/v write for them alone. The embeddings and each row's rotary angles
        are looked up inside the call, as the per-layer path's embed_inputs and rotary_cos_sin
        do."""
        ids, positions = input_ids.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        tokens = ids.shape[0]
        x = torch.empty(tokens, self._shape.hidden)  # becomes the residual stream
        rows, keep = _step_rows(meta, tokens)  # keep: what rows points into, alive till return
        if out_rows is None:
            out = torch.empty_like(x)
        else:
            out_rows = out_rows.to(torch.int64).contiguous()
            keep.append(out_rows)
            rows.n_out, rows.out_rows = out_rows.shape[0], out_rows.data_ptr()
            out = x.new_empty(out_rows.shape[0], x.shape[1])
        status = self._lib.step_stack(ctypes.byref(self._shape), self._layers, ctypes.byref(rows),
                                      ids.data_ptr(), positions.data_ptr(), x.data_ptr(), out.data_ptr())
        if status == -2:
            raise ValueError(f"decoder stack: out_rows must be rows of the step's {tokens}, "
                             "strictly ascending")
        if status == -3:
            raise ValueError(f"decoder stack: token ids must lie in 0 .. {self._shape.vocab - 1} "
                             f"and positions in 0 .. {self._shape.positions - 1}")
        if status != 0:
            raise MemoryError(f"decoder stack: no memory for the scratch of a {tokens}-token step")
        return out


def _step_rows(meta: AttentionMetadata, tokens: int) -> tuple[_StepRows, list[object]]:
    """The C description of what each row attends to, and what its pointers point into."""
    slots = meta.slot_mapping.contiguous()
    rows, keep = _StepRows(tokens, slots.data_ptr(), n_out=-1), [slots]  # n_out -1: every row
    if meta.decode_rows is not None:
        ctx, lens = meta.decode_slots.contiguous(), meta.decode_lens.contiguous()
        keep += [ctx, lens]
        rows.n_decode, rows.max_len = lens.shape[0], ctx.shape[1]
        rows.ctx_slots, rows.lens = ctx.data_ptr(), lens.data_ptr()
        if not meta.all_decode:  # else the decode rows are rows 0 .. T - 1
            decode_rows = meta.decode_rows.contiguous()
            keep.append(decode_rows)
            rows.decode_rows = decode_rows.data_ptr()
    if meta.prefills:
        ctx_slots = [seg.ctx_slots.contiguous() for seg in meta.prefills]
        chunks = (_Chunk * len(ctx_slots))(*(
            _Chunk(seg.start, seg.end - seg.start, s.data_ptr(), s.shape[0])
            for seg, s in zip(meta.prefills, ctx_slots, strict=True)))
        keep += [*ctx_slots, chunks]
        rows.n_chunks, rows.chunks = len(ctx_slots), chunks
    return rows, keep
