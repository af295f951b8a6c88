"""Attention as ONNX Runtime's fused `com.microsoft::MultiHeadAttention` in exported graphs (`export_onnx`).

The dynamo exporter lowers the backbone's attention (`attend`: head split, QK^T, mask, softmax, V, head merge) to
~15 generic nodes per attention, most of them Transposes and Reshapes that cost a decoding step as much as its
GEMMs. During an export with fusion, every attention module that computes plain scaled dot-product attention runs
`fused_forward` instead of its own `forward`: its projections are the module's, and the kernel is one custom torch
op (`hf_variants_onnx::multi_head_attention`, below) that the exporter translates to ONE `MultiHeadAttention` node
(`TRANSLATION_TABLE`, passed as `torch.onnx.export(custom_translation_table=...)`):

- encoder self-attention (and the Tied Transformer's shared blocks on the encoder path): queries, keys and values
  [batch, length, heads * head_dim], the source padding as `key_padding_mask` [batch, source] (int32, 1 = token);
- decoder self-attention on the step graph's cache: the new token's keys/values [batch, 1, hidden] and the cache
  as `past_key` / `past_value` [batch, heads, past, head_dim] (BNSH, the layout of the step graph's cache inputs)
  -> `present_key` / `present_value` (past + 1), which become the step graph's cache outputs;
- cross-attention on the cached source keys/values [batch, heads, source, head_dim] (BNSH) with the source padding;
  in the shared-cache step graph the keys/values and the padding come once per sentence, and each sentence's rows
  (its beams) are the queries of one MultiHeadAttention (custom op `hf_variants_onnx::sentence_cross_attention`:
  Reshape, MultiHeadAttention, Reshape);
- decoder self-attention on the shared-cache step graph's buffers (`SharedBufferCache`): ONE
  `com.microsoft::DecoderMaskedMultiHeadAttention` (`past_present_share_buffer=1`; custom op
  `hf_variants_onnx::decoder_masked_multi_head_attention`) reading the buffers [batch, heads, capacity, head_dim],
  `past_sequence_length`, `beam_width` and `cache_indirection`, and writing the new position into the buffers.

MUTE's units and MIMO's streams put n attentions side by side on the head axis (unit k owns heads k*H .. (k+1)*H-1,
as in the torch kernel call), which is n*H heads of one MultiHeadAttention. `fusion_blocker(module)` names what keeps
a module on the generic path: Shaw relative positions (a query-dependent score term, and with relative values a
term on the output), HySAN's per-branch masks, MG-SA's phrase heads (any attention class that overrides the kernel
call). The op's torch implementation computes what MultiHeadAttention computes (masked keys get `MASK_FILTER_VALUE`
added before the softmax), so a model with fused modules also runs in torch (`fuse_attention` is tested there
against the unfused model). Tooling: imported by `export_onnx` only (registers the custom op on import).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from ..modeling_transformer_nmt import TransformerNmtAttention, self_attention_cache

MASK_FILTER_VALUE = -10000.0  # MultiHeadAttention's default `mask_filter_value`, added to the scores of padded keys


@torch.library.custom_op("hf_variants_onnx::multi_head_attention", mutates_args=())
def multi_head_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    num_heads: int,
    scale: float,
) -> Tensor:
    """MultiHeadAttention without a cache: query [B, S, N*D]; key/value [B, L, N*D] or BNSH [B, N, L, D];
    key_padding_mask [B, L] int32 (0 = padding) or None -> [B, S, N*D]."""
    batch, length = query.shape[:2]
    q = query.view(batch, length, num_heads, -1).transpose(1, 2)
    if key.dim() == 3:
        key = key.view(batch, key.shape[1], num_heads, -1).transpose(1, 2)
        value = value.view(batch, value.shape[1], num_heads, -1).transpose(1, 2)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale
    if key_padding_mask is not None:
        scores = scores + (key_padding_mask[:, None, None, :] == 0).to(scores.dtype) * MASK_FILTER_VALUE
    out = torch.matmul(torch.softmax(scores, dim=-1), value)
    return out.transpose(1, 2).reshape(batch, length, -1)


@multi_head_attention.register_fake
def _(query, key, value, key_padding_mask, num_heads, scale):
    hidden = value.shape[-1] * num_heads if value.dim() == 4 else value.shape[-1]
    return query.new_empty(query.shape[0], query.shape[1], hidden)


@torch.library.custom_op("hf_variants_onnx::multi_head_attention_with_past", mutates_args=())
def multi_head_attention_with_past(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    past_key: Tensor,
    past_value: Tensor,
    num_heads: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """MultiHeadAttention on a self-attention cache: query/key/value [B, S, N*D] (the new positions), past [B, N, P,
    D] -> (output [B, S, N*D], present_key, present_value [B, N, P+S, D]). No causal mask: a decoding step (S = 1)
    sees the whole cache and itself."""
    batch, length = key.shape[:2]
    present_key = torch.cat([past_key, key.view(batch, length, num_heads, -1).transpose(1, 2)], dim=2)
    present_value = torch.cat([past_value, value.view(batch, length, num_heads, -1).transpose(1, 2)], dim=2)
    out = multi_head_attention(query, present_key, present_value, None, num_heads, scale)
    return out, present_key, present_value


@multi_head_attention_with_past.register_fake
def _(query, key, value, past_key, past_value, num_heads, scale):
    batch, length = key.shape[:2]
    heads, past, head_dim = past_key.shape[1:]
    present = (batch, heads, past + length, head_dim)
    return (
        query.new_empty(batch, query.shape[1], heads * head_dim),
        past_key.new_empty(present),
        past_value.new_empty(present),
    )


@torch.library.custom_op("hf_variants_onnx::sentence_cross_attention", mutates_args=())
def sentence_cross_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor,
    num_heads: int,
    scale: float,
) -> Tensor:
    """Cross-attention of `rows` = sentences * G decoding rows (the G beams of a sentence adjacent, as generate()
    expands them) on the sources of the sentences: query [rows, S, N*D]; key/value BNSH [sentences, N, L, D];
    key_padding_mask [sentences, L] int32 (0 = padding) -> [rows, S, N*D]. As ONE MultiHeadAttention whose
    queries are each sentence's G*S rows: the keys/values are read once per sentence rather than once per row
    (beam 4: a quarter of the memory traffic, and per head one product of G queries instead of G of one)."""
    rows, length, hidden = query.shape
    sentences = key.shape[0]
    if rows % sentences:
        raise ValueError(f"sentence_cross_attention: {rows} rows are not whole groups of {sentences} sentences.")
    grouped = query.reshape(sentences, rows // sentences * length, hidden)
    out = multi_head_attention(grouped, key, value, key_padding_mask, num_heads, scale)
    return out.reshape(rows, length, hidden)


@sentence_cross_attention.register_fake
def _(query, key, value, key_padding_mask, num_heads, scale):
    return query.new_empty(query.shape)


@torch.library.custom_op("hf_variants_onnx::decoder_masked_multi_head_attention", mutates_args=())
def decoder_masked_multi_head_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    past_key: Tensor,
    past_value: Tensor,
    past_sequence_length: Tensor,
    beam_width: Tensor,
    cache_indirection: Tensor,
    num_heads: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """DecoderMaskedMultiHeadAttention on a preallocated self-attention buffer (`past_present_share_buffer=1`): one
    new position per row. query/key/value [rows, 1, N*D]; past_key/past_value [rows, N, capacity, D], positions
    0 .. past-1 filled (`past_sequence_length` int32 [1] = past < capacity); `beam_width` int32 [1] = W (rows =
    sentences * W); `cache_indirection` int32 [rows / W, W, capacity]: row r = s*W + w reads position t < past from
    buffer row s*W + cache_indirection[s, w, t] (a beam of the same sentence), and its new position `past` from its
    own key/value, which it writes at `past` of its own buffer row. Returns (output [rows, 1, N*D], present_key,
    present_value: the buffers with that position written; ONNX Runtime writes it in place where the buffers are
    bound as both input and output). As ONNX Runtime's CPU kernel computes it (tested against it)."""
    rows, heads, capacity, head_dim = past_key.shape
    past, beams = int(past_sequence_length.reshape(-1)[0]), int(beam_width.reshape(-1)[0])
    if not 0 <= past < capacity or beams < 1 or rows % beams:
        raise ValueError(
            f"decoder_masked_multi_head_attention: past_sequence_length={past} must lie in [0, capacity={capacity}) "
            f"and beam_width={beams} divide the {rows} rows."
        )
    present_key, present_value = past_key.clone(), past_value.clone()
    present_key[:, :, past] = key.reshape(rows, heads, head_dim)
    present_value[:, :, past] = value.reshape(rows, heads, head_dim)
    row = torch.arange(rows, device=query.device)
    source = (row // beams * beams)[:, None] + cache_indirection.reshape(rows, capacity)[:, :past].long()
    source = torch.cat([source, row[:, None]], dim=1)  # [rows, past + 1]: the buffer row of each position
    position = torch.arange(past + 1, device=query.device)
    keys = present_key[source, :, position].transpose(1, 2)  # [rows, past + 1, N, D] -> BNSH
    values = present_value[source, :, position].transpose(1, 2)
    out = multi_head_attention(query, keys.contiguous(), values.contiguous(), None, num_heads, scale)
    return out, present_key, present_value


@decoder_masked_multi_head_attention.register_fake
def _(query, key, value, past_key, past_value, past_sequence_length, beam_width, cache_indirection, num_heads, scale):
    rows, heads, _, head_dim = past_key.shape
    return (
        query.new_empty(rows, query.shape[1], heads * head_dim),
        past_key.new_empty(past_key.shape),
        past_value.new_empty(past_value.shape),
    )


def _contrib_op(name: str, input_names: tuple, int32_inputs: tuple, num_outputs: int, attributes: tuple):
    """ONNX Runtime's `com.microsoft::<name>` attention op for onnxscript (the onnx package has no schema for ORT's
    contrib ops): `query`, then the optional `input_names` (those in `int32_inputs` int32, the others float), the
    first `num_outputs` of (output, present_key, present_value); `num_heads` and the optional float `scale` and
    `mask_filter_value` attributes, plus the optional int `attributes`."""
    import onnx
    from onnxscript.values import Op, Opset

    schema = onnx.defs.OpSchema
    optional = schema.FormalParameterOption.Optional
    inputs = [schema.FormalParameter("query", "T")] + [
        schema.FormalParameter(n, "M" if n in int32_inputs else "T", param_option=optional) for n in input_names
    ]
    outputs = [schema.FormalParameter("output", "T")] + [
        schema.FormalParameter(n, "T", param_option=optional) for n in ("present_key", "present_value")
    ][: num_outputs - 1]
    attribute, kind = schema.Attribute, schema.AttrType
    op_schema = schema(
        name,
        "com.microsoft",
        1,
        inputs=inputs,
        outputs=outputs,
        type_constraints=[("T", ["tensor(float)"], ""), ("M", ["tensor(int32)"], "")],
        attributes=[
            attribute("num_heads", kind.INT, "", required=True),
            *[attribute(a, kind.INT, "", required=False) for a in attributes],
            attribute("scale", kind.FLOAT, "", required=False),
            attribute("mask_filter_value", kind.FLOAT, "", required=False),
        ],
    )
    return Op(Opset("com.microsoft", 1), name, op_schema)


def _onnx_op(num_outputs: int):
    """`com.microsoft::MultiHeadAttention`: the inputs up to `past_value`, the first `num_outputs` outputs."""
    names = ("key", "value", "bias", "key_padding_mask", "attention_bias", "past_key", "past_value")
    return _contrib_op("MultiHeadAttention", names, ("key_padding_mask",), num_outputs, ())


def _decoder_masked_onnx_op():
    """`com.microsoft::DecoderMaskedMultiHeadAttention`: inputs up to `cache_indirection`; outputs (output,
    present_key, present_value)."""
    int32 = ("mask_index", "past_sequence_length", "beam_width", "cache_indirection")
    names = ("key", "value", "mask_index", "attention_bias", "past_key", "past_value") + int32[1:]
    return _contrib_op("DecoderMaskedMultiHeadAttention", names, int32, 3, ("past_present_share_buffer",))


def translation_table() -> dict:
    """The exporter's `custom_translation_table`: each custom op -> a function emitting its one node
    (MultiHeadAttention, DecoderMaskedMultiHeadAttention)."""
    attention, attention_with_past = _onnx_op(1), _onnx_op(3)

    def to_onnx(query, key, value, key_padding_mask, num_heads: int, scale: float):
        return attention(
            query,
            key,
            value,
            None,
            key_padding_mask,
            num_heads=num_heads,
            scale=scale,
            mask_filter_value=MASK_FILTER_VALUE,
        )

    def with_past_to_onnx(query, key, value, past_key, past_value, num_heads: int, scale: float):
        return attention_with_past(
            query, key, value, None, None, None, past_key, past_value, num_heads=num_heads, scale=scale
        )

    def sentence_cross_to_onnx(query, key, value, key_padding_mask, num_heads: int, scale: float):
        from onnxscript import opset18 as op

        # [rows, S, hidden] -> [sentences, rows / sentences * S, hidden] -> MultiHeadAttention -> [rows, S, hidden].
        # The shapes come from the source padding (one tensor for every layer) and the query's static axes, so
        # that ONNX Runtime folds them (constant folding, common subexpressions) to one Shape + Concat per graph
        # (small, 3 layers, optimized: 5 nodes more than the graph with keys/values per row; shapes taken from
        # each layer's keys and query left 9)
        shape = op.Concat(
            op.Shape(key_padding_mask, start=0, end=1),
            op.Constant(value_ints=[-1]),
            op.Shape(query, start=2),
            axis=0,
        )
        out = to_onnx(op.Reshape(query, shape), key, value, key_padding_mask, num_heads, scale)
        return op.Reshape(out, op.Concat(op.Constant(value_ints=[-1]), op.Shape(query, start=1), axis=0))

    decoder_masked = _decoder_masked_onnx_op()

    def decoder_masked_to_onnx(
        query, key, value, past_key, past_value, past_sequence_length, beam_width, cache_indirection, num_heads, scale
    ):
        return decoder_masked(
            query,
            key,
            value,
            None,
            None,
            past_key,
            past_value,
            past_sequence_length,
            beam_width,
            cache_indirection,
            num_heads=num_heads,
            past_present_share_buffer=1,
            scale=scale,
        )

    return {
        torch.ops.hf_variants_onnx.multi_head_attention.default: to_onnx,
        torch.ops.hf_variants_onnx.multi_head_attention_with_past.default: with_past_to_onnx,
        torch.ops.hf_variants_onnx.sentence_cross_attention.default: sentence_cross_to_onnx,
        torch.ops.hf_variants_onnx.decoder_masked_multi_head_attention.default: decoder_masked_to_onnx,
    }


# ------------------------------------------------------------------------------------------- the modules' side
def fusion_blocker(module: TransformerNmtAttention) -> str | None:
    """Why `module` cannot run as MultiHeadAttention (None: it can)."""
    config = module.config
    if module.relative_positions is not None or module.relative_embeddings is not None:
        return (
            f"Shaw relative positions (max_relative_positions={config.max_relative_positions}"
            + (", relative values" if config.relative_position_values else "")
            + ")"
        )
    plain = type(module)._project is TransformerNmtAttention._project and (
        type(module)._attend is TransformerNmtAttention._attend
    )
    if not plain and getattr(module, "phrase_memory", "absent") is not None:
        # MG-SA's class without phrase heads (phrase_memory None) delegates both steps to the backbone's
        return f"{type(module).__name__} computes its own attention ({type(module).__module__.rsplit('.', 1)[-1]})"
    return None


class _SourceMask:
    """The source padding of the graph being traced, [B, source] int32: what every fused encoder self-attention
    and cross-attention masks its keys with (set by the graph wrappers through `source_padding`)."""

    value: Tensor | None = None


@contextlib.contextmanager
def source_padding(attention_mask: Tensor):
    """Within the block, fused attentions mask source keys with `attention_mask` ([B, source], 0 = padding)."""
    previous, _SourceMask.value = _SourceMask.value, attention_mask.to(torch.int32)
    try:
        yield
    finally:
        _SourceMask.value = previous


def _merge_heads(module: TransformerNmtAttention, x: Tensor, parts: int) -> tuple[Tensor, ...]:
    """A projection's output [B, T, parts*d] (or [n, B, T, parts*d] with units) -> `parts` tensors
    [B, T, heads*D], heads in the kernel's order (unit-major with units)."""
    if module.num_units is None:
        return x.split(module.embed_dim, dim=-1) if parts > 1 else (x,)
    n, b, t, _ = x.shape
    x = x.view(n, b, t, parts, module.embed_dim).permute(3, 1, 2, 0, 4).reshape(parts, b, t, n * module.embed_dim)
    return x.unbind(0)


def fused_forward(
    self: TransformerNmtAttention,
    hidden_states: Tensor,
    attention_mask=None,
    key_value_states=None,
    cache=None,
    output_attentions: bool = False,
    **kwargs,
):
    """`TransformerNmtAttention.forward` with the kernel as one MultiHeadAttention where the call is one of the
    three the exported graphs make (see the module docstring); any other call runs the module's own forward."""
    generic = TransformerNmtAttention.forward
    if output_attentions or _SourceMask.value is None:
        return generic(self, hidden_states, attention_mask, key_value_states, cache, False, **kwargs)
    if self.is_cross_attention:
        if cache is None or not cache.is_updated.get(self.layer_idx):
            # the source graph computes the cross keys/values here; its attention output is not used
            return generic(self, hidden_states, attention_mask, key_value_states, cache, False, **kwargs)
        layer = cache.cross_attention_cache.layers[self.layer_idx]
        (query,) = _merge_heads(self, self.q_proj(hidden_states), 1)
        # the shared-cache step graph takes the cross keys/values once per sentence; the other graphs once per row
        kernel = (
            sentence_cross_attention
            if isinstance(self_attention_cache(cache), SharedBufferCache)
            else multi_head_attention
        )
        out = kernel(query, layer.keys, layer.values, _SourceMask.value, self.num_heads, float(self.scaling))
        return self._project_out(out.view(*out.shape[:2], self.num_heads, self.head_dim), hidden_states), None, None
    own = self_attention_cache(cache)
    query, key, value = _merge_heads(self, self.qkv_proj(hidden_states), 3)
    if own is None:
        if kwargs.get("is_causal", self.is_causal):
            return generic(self, hidden_states, attention_mask, key_value_states, cache, False, **kwargs)
        out = multi_head_attention(query, key, value, _SourceMask.value, self.num_heads, float(self.scaling))
    elif isinstance(own, SharedBufferCache):
        if query.shape[1] != 1:
            raise ValueError(f"The shared-cache step takes one new position per row, not {query.shape[1]}.")
        layer = own.layers[self.layer_idx]
        out, layer.keys, layer.values = decoder_masked_multi_head_attention(
            query,
            key,
            value,
            layer.keys,
            layer.values,
            own.past_sequence_length,
            own.beam_width,
            own.cache_indirection,
            self.num_heads,
            float(self.scaling),
        )
    else:
        layers = own.layers
        if self.layer_idx >= len(layers) or not layers[self.layer_idx].is_initialized or query.shape[1] != 1:
            # an empty cache (the source graph's start step, whose self-attention output is not used)
            return generic(self, hidden_states, attention_mask, key_value_states, cache, False, **kwargs)
        layer = layers[self.layer_idx]
        out, layer.keys, layer.values = multi_head_attention_with_past(
            query, key, value, layer.keys, layer.values, self.num_heads, float(self.scaling)
        )
    return self._project_out(out.view(*out.shape[:2], self.num_heads, self.head_dim), hidden_states), None, None


class SharedBufferCache(DynamicCache):
    """The self-attention cache of the shared-cache step graph (`export_onnx`) while it is traced: per layer the
    preallocated buffers [rows, heads, capacity, head_dim] as the layer's keys/values, and what
    DecoderMaskedMultiHeadAttention reads beside them: `past_sequence_length` (int32 [1], the filled positions),
    `beam_width` (int32 [1]) and `cache_indirection` (int32 [rows / beam_width, beam_width, capacity]). Every fused
    decoder self-attention (`fused_forward`) runs `decoder_masked_multi_head_attention` on its layer and leaves the
    written buffers as the layer's keys/values. `get_seq_length()` is the filled length as a 0-d tensor (what a
    static cache gives): the queries' position, computed in the graph from `past_sequence_length`."""

    is_compileable = False  # a decoding step attends to every filled position: no mask (self_attention_mask)

    def __init__(self, buffers, past_sequence_length: Tensor, beam_width: Tensor, cache_indirection: Tensor):
        super().__init__(buffers)
        self.past_sequence_length, self.beam_width = past_sequence_length, beam_width
        self.cache_indirection = cache_indirection

    def get_seq_length(self, layer_idx: int = 0) -> Tensor:
        return self.past_sequence_length.reshape(()).long()


_FUSED_CLASSES: dict[type, type] = {}


def unfused_decoder_attention(model) -> dict[str, str]:
    """The decoder attention modules (self- and cross-attention) of `model` that `fuse_attention` did not make fused,
    by module name, with the reason (`fusion_blocker`); {} where all are fused (the shared-cache step graph needs
    every one: its self-attention reads the shared buffers, its cross-attention the keys/values per sentence)."""
    decoder = model.get_decoder()
    modules = [m for m in decoder.modules() if isinstance(m, TransformerNmtAttention)]
    names = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), name)
    return {
        names.get(id(m), type(m).__name__): fusion_blocker(m) or "not fused (attention fusion disabled)"
        for m in modules
        if type(m) not in _FUSED_CLASSES.values()
    }


def fuse_attention(model) -> dict:
    """Make every attention module of `model` (in place: the exporter's own copy) that `fusion_blocker` lets through
    run `fused_forward`. Returns {"fused": [module names], "generic": {module name: reason}}."""
    fused, generic = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, TransformerNmtAttention):
            continue
        reason = fusion_blocker(module)
        if reason is not None:
            generic[name] = reason
            continue
        cls = type(module)
        if cls not in _FUSED_CLASSES:
            _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (cls,), {"forward": fused_forward})
        module.__class__ = _FUSED_CLASSES[cls]
        fused.append(name)
    return {"fused": fused, "generic": generic}
