"""Export any hf_variants model to ONNX (two or three graphs) for ONNX Runtime, in float32 and optionally int8.

    python -m hf_variants.export_onnx --model DIR --output_dir OUT [--int8 [--int8_weights s8_reduce_range|u8]
        [--int8_activations per_row|per_tensor|calibrated [--calibration_data FILE [--calibration_src_lang CODE]]]]
        [--opset N] [--force] [--no_fuse_attention] [--no_shared_cache]
        [--scoring_graph]

Two graphs (three with fused decoder self-attention), all traced through the model's public forward (`get_encoder()`,
then the model with `encoder_outputs`, `cache` as an `EncoderDecoderCache` and `use_cache=True`) by the
dynamo exporter (`torch.onnx.export(..., dynamo=True)`; the TorchScript exporter cannot trace the sinusoidal position
table):

- `encoder_model.onnx` (source graph): `input_ids`, `attention_mask` and the variant's source inputs (MIMO/Tied
  `tgt_lang_ids`, the syntactic MG-SA's `phrase_index`) -> the encoder output tensors (`encoder_last_hidden_state`,
  MIMO's `encoder_streams`) and every decoder layer's cross-attention keys/values (`cross_key.{i}`,
  `cross_value.{i}`), computed once per source by running the decoder one step on a start token;
- `decoder_model.onnx` (step graph): `decoder_input_ids` [batch, 1], `encoder_attention_mask`, the encoder output
  tensors, the decoder-side variant inputs (`tgt_lang_ids`), the self-attention cache (`past_key.{i}`,
  `past_value.{i}` [batch, heads, past, head_dim]; past 0 at the first step) and the cross keys/values ->
  `logits` [batch, 1, vocab] and `present_key.{i}`, `present_value.{i}` (past + 1);
- `decoder_model_shared_cache.onnx` (shared-cache step graph, written where every decoder attention is fused,
  see below): the step graph's inputs with preallocated buffers as `past_key.{i}` / `past_value.{i}` [batch,
  heads, capacity, head_dim] (positions 0 .. past-1 filled) and `past_sequence_length` (int32 [1]), `beam_width`
  (int32 [1]), `cache_indirection` (int32 [batch / beam_width, beam_width, capacity]: for each row and filled
  position, the beam of the same sentence whose buffer row holds it) before the cross keys/values -> `logits` and
  `present_key.{i}`, `present_value.{i}`: the buffers with position `past` written, in place where the caller binds
  the same memory as input and output (each decoder self-attention is ONE `com.microsoft::DecoderMaskedMultiHead
  Attention` with `past_present_share_buffer=1`). A decoding step then copies no cache, and beam search reorders
  the indirection instead of the cache (`OrtModelForSeq2SeqLM`'s bound search and loop, `OrtSharedCache`). The source
  padding `encoder_attention_mask` and the cross keys/values come once per sentence ([batch / beam_width, ...]:
  each cross-attention takes a sentence's beams as the queries of one MultiHeadAttention; the manifest's
  `shared_cache["cross_attention"]` is "per_sentence"; one per row is one sentence per row). The manifest's
  `shared_cache` names the files, inputs and outputs, or why the graph is not written (the modules left generic).
  The step graph is written either way: the loop of the model types without the shared-cache graph reads it, as
  any consumer on plain onnxruntime can.

`--scoring_graph` also writes `scoring_model.onnx` (scoring graph, for forced decoding of given pairs:
`hf-variants-score --onnx`): the whole model over a whole target in one run. `input_ids`, `attention_mask`, the
source graph's variant inputs, `decoder_input_ids` [batch, target] (the start token, then the target but its last
token) and `labels` [batch, target] (the target's token ids, any valid id at padded positions) -> `token_log_probs`
[batch, target]: each label's log-softmax of the raw logits (what the step graph gives one position at a time,
without the [batch, target, vocabulary] logits leaving the graph). The manifest's `scoring` names it (and its int8
copy).

Attention fusion (default; `--no_fuse_attention` turns it off): every attention module computing plain scaled
dot-product attention is exported as ONE `com.microsoft::MultiHeadAttention` node of ONNX Runtime (`attention`:
encoder self-attention with the source padding mask, decoder self-attention reading `past_*` and writing
`present_*`, cross-attention on the cached `cross_*` keys/values) instead of ~15 generic nodes; the others (Shaw
relative positions: MUTE's self-attention by default; HySAN's branch masks) stay generic, and the manifest's
`attention_fusion` names both, with the reason. The graph inputs and outputs are the same either way. ONNX Runtime
fuses int8 MatMul + scale (DynamicQuantizeMatMul) itself at session creation (`ORT_ENABLE_ALL`, as
`OrtModelForSeq2SeqLM` sets; its sessions leave out SkipLayerNormFusion, `modeling.DISABLED_OPTIMIZERS` says why).

Batch, source and past lengths are dynamic. Every model type exports (MUTE, HySAN, MIMO, Tied, the baseline, MG-SA):
MG-SA's phrase heads, n-gram or syntactic (then `phrase_index` [batch, levels, source] is an input of the source
graph, and a level has up to `source` phrase slots), with any interaction (the ON-LSTM / LSTM over the phrases is
traced as one `scan`, an ONNX `Scan` over the source's phrase slots) and any composition. Not exportable, and the
exporter says so naming the config fields: the syntactic MG-SA with the LSTM composition (as many recurrent steps
as its longest phrase, which only the values of `phrase_index` tell). The tokenizer, config,
generation config and `onnx_manifest.json` (graph files, input/output names and dtypes, exporter versions, int8
settings) are written beside the graphs.
`--int8` also writes `encoder_model_int8.onnx` / `decoder_model_int8.onnx` (and `decoder_model_shared_cache_int8.onnx`
where the shared-cache graph is written; `quantization.quantize`: onnxruntime's `quantize_dynamic` after folding
constants and splitting stacked unit weights, int8 weights of every MatMul per output channel, the output projection
included; `--int8_weights`: the weight format, see `INT8_WEIGHTS`) with activations quantized per row (one scale per
token, so a sentence's translation does not depend on the other sentences of its batch; the int8 graphs are opset
21) or, with `--int8_activations per_tensor`, per call over the whole batch (quantize_dynamic's own scheme, what
folders exported before had), or with `--int8_activations calibrated --calibration_data FILE` one fixed scale per
activation, the largest value it took while the per-row graphs translated FILE's sentences (a Relu's output stays per
row; batch-independent too, and as fast as per tensor: `calibration`). The manifest's `int8.activations` records
which.

Load with `hf_variants.OrtModelForSeq2SeqLM.from_pretrained(OUT)` (the fp32 graphs; `precision="int8"` for the int8
ones) for generate and the pipeline. The export prints one progress line per graph on stderr. The graphs run on plain
onnxruntime; the generate() wrapper is hf_variants' (the folder has no Python code). Needs
`pip install "hf-variants[onnx]"`. (Tooling: not shipped with saved models.)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from ..compat_transformer_nmt import output_cache
from ..outputs import (
    check_not_an_input,
    check_output_dir,
    commit_output_dir,
    start_output_dir,
)
from .attention import (
    SharedBufferCache,
    fuse_attention,
    source_padding,
    translation_table,
    unfused_decoder_attention,
)
from .calibration import apply_calibration, calibrate, check_calibration_language
from .manifest import CALIBRATED, INT8_ACTIVATIONS
from .quantization import (
    DEFAULT_INT8_ACTIVATIONS,
    DEFAULT_INT8_WEIGHTS,
    INT8_WEIGHTS,
    PER_ROW_OPSET,
    QUANTIZED_OP_TYPES,
    quantize,
)

MANIFEST = "onnx_manifest.json"
COMMAND = "export_onnx"  # recorded in the output folder's manifest: what `--force` may replace
GRAPH_FILES = {
    "fp32": ("encoder_model.onnx", "decoder_model.onnx"),
    "int8": ("encoder_model_int8.onnx", "decoder_model_int8.onnx"),
}
SHARED_CACHE_FILES = {"fp32": "decoder_model_shared_cache.onnx", "int8": "decoder_model_shared_cache_int8.onnx"}
SCORING_FILES = {"fp32": "scoring_model.onnx", "int8": "scoring_model_int8.onnx"}
SHARED_CACHE_OP = "com.microsoft::DecoderMaskedMultiHeadAttention"
SHARED_CACHE_INPUTS = ["past_sequence_length", "beam_width", "cache_indirection"]
# the manifest's shared_cache["cross_attention"]: the graph takes the source padding and the cross-attention
# keys/values once per sentence (absent in folders exported before: once per row)
CROSS_PER_SENTENCE = "per_sentence"

MIN_OPSET = 18  # the dynamo exporter's lowest
SAMPLE_SOURCE_LENGTH = 7  # the source length of the export's sample: a size no other axis has (found by value)


def _language_field(model) -> str | None:
    return getattr(model.model, "language_ids_field", None)


def _syntactic_phrases(config) -> bool:
    return config.model_type == "mgsa_nmt" and config.phrase_type == "syntactic" and _has_phrase_heads(config)


def _has_phrase_heads(config) -> bool:
    return bool(config.mgsa_layers and config.num_phrase_groups)


def source_input_names(model) -> list[str]:
    """The variant inputs of the source graph, beside `input_ids` and `attention_mask`: MIMO's and Tied's target
    language, the syntactic MG-SA's `phrase_index` [batch, levels, source] (`phrase_tags` only feed its training
    loss)."""
    names = ["tgt_lang_ids"] if _language_field(model) is not None else []
    return names + (["phrase_index"] if _syntactic_phrases(model.config) else [])


def step_input_names(model) -> list[str]:
    """The variant inputs of the step graph (what the decoder reads per step): MIMO's and Tied's target language."""
    return ["tgt_lang_ids"] if _language_field(model) is not None else []


def check_exportable(model, opset: int | None = None) -> None:
    """Raise a ValueError naming the model type, config field or option the exporter cannot express."""
    from ..model_classes import MODEL_CLASSES

    config = model.config
    if config.model_type not in MODEL_CLASSES:
        raise ValueError(
            f"export_onnx: unsupported model type {config.model_type!r} (supported: {sorted(MODEL_CLASSES)})."
        )
    if opset is not None and opset < MIN_OPSET:
        raise ValueError(
            f"export_onnx: --opset {opset} is not supported: the dynamo exporter needs opset >= {MIN_OPSET}."
        )
    if _syntactic_phrases(config) and config.phrase_composition == "lstm":
        raise ValueError(
            f"export_onnx: mgsa_nmt with syntactic phrase heads (mgsa_layers={config.mgsa_layers}, "
            "phrase_type='syntactic') and phrase_composition='lstm' is not supported: the LSTM composition runs "
            "as many steps as the longest phrase has tokens, which only the values of `phrase_index` tell (n-gram "
            "phrases bound it by the largest n). The 'san' (default) and 'max_pool' compositions export."
        )
    if not config.is_encoder_decoder:
        raise ValueError(f"export_onnx: {config.model_type} with is_encoder_decoder=False is not supported.")


def _encoder_fields(encoder_outputs) -> dict[str, torch.Tensor]:
    """The tensor fields of an encoder output (ModelOutput), in order; auxiliary losses are training-only."""
    return {
        name: value
        for name, value in encoder_outputs.items()
        if isinstance(value, torch.Tensor) and name != "aux_losses"
    }


def _layer_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


class SourceGraph(nn.Module):
    """Source inputs -> encoder output tensors + cross-attention keys/values of every decoder layer."""

    def __init__(self, model, source_names: list[str], step_names: list[str], field_names: list[str]):
        super().__init__()
        self.model, self.source_names, self.step_names, self.field_names = model, source_names, step_names, field_names
        self.eval()

    def forward(self, input_ids, attention_mask, *extra):
        kwargs = dict(zip(self.source_names, extra))
        with source_padding(attention_mask):  # what fused attentions mask (without fusion: not read)
            encoder_outputs = self.model.get_encoder()(
                input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **kwargs
            )
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            start = input_ids.new_full((input_ids.shape[0], 1), self.model.config.decoder_start_token_id)
            self.model(
                encoder_outputs=encoder_outputs,
                attention_mask=attention_mask,
                decoder_input_ids=start,
                cache=cache,
                use_cache=True,
                return_dict=True,
                **{name: kwargs[name] for name in self.step_names},
            )
        fields = _encoder_fields(encoder_outputs)
        cross = [t for kv in _layer_kv(cache.cross_attention_cache) for t in kv]
        return (*[fields[name] for name in self.field_names], *cross)


class StepGraph(nn.Module):
    """One decoder step on explicit tensors: the cache is rebuilt as an `EncoderDecoderCache` from the past
    self-attention and the cross-attention keys/values (cross-attention marked computed by the cache)."""

    # whether the model gets the source padding as its `attention_mask` (per row) besides the fused attentions
    # (`source_padding`)
    model_reads_source_padding = True

    def __init__(self, model, step_names: list[str], field_names: list[str], output_class, num_layers: int):
        super().__init__()
        self.model, self.step_names, self.field_names = model, step_names, field_names
        self.output_class, self.num_layers = output_class, num_layers
        self.eval()

    def self_attention_cache(self, tensors: tuple):
        """The self-attention cache from the graph's cache inputs (before the cross keys/values) and their count:
        here the past keys/values of every layer."""
        n = self.num_layers
        return DynamicCache([(tensors[2 * i], tensors[2 * i + 1]) for i in range(n)]), 2 * n

    def forward(self, decoder_input_ids, encoder_attention_mask, *flat):
        n_fields, n_step, n = len(self.field_names), len(self.step_names), self.num_layers
        fields = dict(zip(self.field_names, flat[:n_fields]))
        kwargs = dict(zip(self.step_names, flat[n_fields : n_fields + n_step]))
        rest = flat[n_fields + n_step :]
        self_cache, used = self.self_attention_cache(rest)
        cross = [(rest[used + 2 * i], rest[used + 2 * i + 1]) for i in range(n)]
        cache = EncoderDecoderCache(self_cache, DynamicCache(cross))
        with source_padding(encoder_attention_mask):
            out = self.model(
                encoder_outputs=self.output_class(**fields),
                attention_mask=encoder_attention_mask if self.model_reads_source_padding else None,
                decoder_input_ids=decoder_input_ids,
                cache=cache,
                use_cache=True,
                return_dict=True,
                **kwargs,
            )
        present = [t for pair in _layer_kv(output_cache(out).self_attention_cache) for t in pair]
        return (out.logits, *present)


class SharedCacheStepGraph(StepGraph):
    """One decoder step on the shared self-attention buffers (`SharedBufferCache`): the step graph's inputs with
    the per-layer buffers [rows, heads, capacity, head_dim] in place of the past, and `past_sequence_length`,
    `beam_width`, `cache_indirection` after them; returns the logits and the buffers (each layer's position
    `past_sequence_length` written by DecoderMaskedMultiHeadAttention). The source padding comes once per sentence
    and only the fused cross-attentions read it (every decoder attention is fused here): the model's own
    cross-attention mask would pair it with the rows."""

    model_reads_source_padding = False

    def self_attention_cache(self, tensors: tuple):
        n = self.num_layers
        buffers = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(n)]
        past_sequence_length, beam_width, cache_indirection = tensors[2 * n : 2 * n + 3]
        return SharedBufferCache(buffers, past_sequence_length, beam_width, cache_indirection), 2 * n + 3


class ScoringGraph(nn.Module):
    """Forced decoding of whole targets: the model's forward over the source and the decoder inputs (no cache), and
    the log-softmax of the raw logits at each label ([batch, target]; padded positions give a value the caller
    ignores)."""

    def __init__(self, model, source_names: list[str]):
        super().__init__()
        self.model, self.source_names = model, source_names
        self.eval()

    def forward(self, input_ids, attention_mask, decoder_input_ids, labels, *extra):
        with source_padding(attention_mask):  # what fused encoder attentions mask
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids,
                use_cache=False,
                return_dict=True,
                **dict(zip(self.source_names, extra)),
            )
        logits = out.logits.float()
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)


def _untie_output_projection(model) -> None:
    """Give the output projection its own weight (a copy of the tied embedding): exported, a tied projection is
    `Transpose(embedding)`, which the quantizer skips and ORT transposes at every step."""
    head = model.get_output_embeddings()
    untied = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
    with torch.no_grad():
        untied.weight.copy_(head.weight)
        if head.bias is not None:
            untied.bias.copy_(head.bias)
    model.set_output_embeddings(untied)


def _sample_inputs(model, source_names: list[str], batch: int, length: int) -> dict[str, torch.Tensor]:
    config = model.config
    generator = torch.Generator().manual_seed(0)
    special = {config.pad_token_id, config.eos_token_id, config.bos_token_id, config.decoder_start_token_id}
    low = max(i for i in special if i is not None) + 1
    input_ids = torch.randint(low, config.vocab_size, (batch, length), generator=generator)
    input_ids[:, -1] = config.eos_token_id
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    input_ids[-1, -2:] = config.pad_token_id  # one padded row: the mask is a real input
    input_ids[-1, -3] = config.eos_token_id
    attention_mask[-1, -2:] = 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "tgt_lang_ids" in source_names:
        inputs["tgt_lang_ids"] = torch.zeros(batch, dtype=torch.long)
    if "phrase_index" in source_names:  # level k: phrases of k + 2 words (the closing </s> in none)
        words = attention_mask.bool() & (input_ids != config.eos_token_id)
        rank = words.long().cumsum(-1) - 1
        levels = torch.arange(2, config.syntactic_levels + 2)[None, :, None]
        inputs["phrase_index"] = torch.where(words[:, None], rank[:, None] // levels, -1)
    return inputs


# what torch's exporter says on every export that tells a user nothing (their export is fine): the axis names of
# dynamic dimensions that share a constraint (ours do by design: every graph input with a batch axis), a deprecation
# inside torch's own pytree code, and that the optional torchvision operators are not registered
_EXPORTER_NOISE = (
    (UserWarning, r"# The axis name: .* will not be used, since it shares the same shape constraints"),
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
)
_EXPORTER_NOISE_LOGGER = "torch.onnx._internal.exporter._registration"


class _DropTorchvisionNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "torchvision is not installed" not in record.getMessage()


@contextlib.contextmanager
def _quiet_exporter():
    """torch.onnx.export without the messages in `_EXPORTER_NOISE` (filtered by category and message, for this
    call only); every other warning and log line of the exporter still shows."""
    noise_filter, logger = _DropTorchvisionNotice(), logging.getLogger(_EXPORTER_NOISE_LOGGER)
    logger.addFilter(noise_filter)
    try:
        with warnings.catch_warnings():
            for category, message in _EXPORTER_NOISE:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        logger.removeFilter(noise_filter)


@contextlib.contextmanager
def _progress(enabled: bool, what: str):
    """One line on stderr per export stage: `what ... done in 3.1 s` (the line completes when the stage does)."""
    if enabled:
        print(f"{what} ...", end="", file=sys.stderr, flush=True)
    started = time.perf_counter()
    yield
    if enabled:
        print(f" done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


def _torch_export(module, args, dynamic_shapes, input_names, output_names, path: Path, opset: int | None):
    kwargs = {"opset_version": opset} if opset is not None else {}
    with _quiet_exporter():
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            input_names=input_names,
            output_names=output_names,
            optimize=True,
            verbose=False,
            custom_translation_table=translation_table(),  # fused attention (`attention`), where it applies
            **kwargs,
        )
        program.save(str(path))
    return program


def _io(path: Path) -> dict:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph

    def describe(values):
        return [
            {
                "name": v.name,
                "dtype": onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower(),
                "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim],
            }
            for v in values
        ]

    return {"inputs": describe(graph.input), "outputs": describe(graph.output)}


def _check_dynamic(path: Path, config_name: str) -> None:
    """Raise a ValueError when torch.export fixed an axis meant to be dynamic (batch, source, past) to the size of
    the export's sample: the graph would refuse every other shape."""
    io = _io(path)
    expected = {
        "input_ids": (0, 1),
        "attention_mask": (0, 1),
        "decoder_input_ids": (0,),
        "encoder_attention_mask": (0, 1),
        "past_key.0": (0, 2),
    }
    for value in io["inputs"]:
        for axis in expected.get(value["name"], ()):
            if not isinstance(value["shape"][axis], str):
                raise ValueError(
                    f"export_onnx: {config_name} is not supported: torch.export fixed axis {axis} of "
                    f"`{value['name']}` in {path.name} to {value['shape'][axis]} (the sample's size); "
                    "the model computes a shape from that length in Python."
                )


@dataclasses.dataclass
class _Traced:
    """What one eager run of the model on the sample fixes for both graphs: the inputs, the encoder fields and the
    cache layout (layers, heads, head size)."""

    sample: dict[str, torch.Tensor]
    source_names: list[str]
    step_names: list[str]
    start: torch.Tensor
    encoder_outputs: Any
    field_names: list[str]
    num_layers: int
    self_kv: list
    cross_kv: list

    @property
    def kv_names(self) -> list[str]:
        return [f"{kind}.{i}" for i in range(self.num_layers) for kind in ("key", "value")]


def _trace(model) -> _Traced:
    source_names, step_names = source_input_names(model), step_input_names(model)
    sample = _sample_inputs(model, source_names, batch=2, length=SAMPLE_SOURCE_LENGTH)
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(**sample, return_dict=True)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        start = torch.full((2, 1), model.config.decoder_start_token_id, dtype=torch.long)
        model(
            encoder_outputs=encoder_outputs,
            attention_mask=sample["attention_mask"],
            decoder_input_ids=start,
            cache=cache,
            use_cache=True,
            **{k: sample[k] for k in step_names},
        )
    return _Traced(
        sample,
        source_names,
        step_names,
        start,
        encoder_outputs,
        list(_encoder_fields(encoder_outputs)),
        len(cache.cross_attention_cache.layers),
        _layer_kv(cache.self_attention_cache),
        _layer_kv(cache.cross_attention_cache),
    )


def _dims():
    """The dynamic axes: batch, source length and past (cache) length."""
    return (
        torch.export.Dim("batch", min=1, max=4096),
        torch.export.Dim("source", min=1, max=4096),
        torch.export.Dim("past", min=0, max=4096),
    )


def _export_source_graph(model, traced: _Traced, path: Path, opset: int | None) -> None:
    batch, src, _ = _dims()
    sample, names = traced.sample, traced.source_names
    shapes = {
        "input_ids": {0: batch, 1: src},
        "attention_mask": {0: batch, 1: src},
        "tgt_lang_ids": {0: batch},
        "phrase_index": {0: batch, 2: src},
    }
    _torch_export(
        SourceGraph(model, names, traced.step_names, traced.field_names),
        (sample["input_ids"], sample["attention_mask"], *[sample[k] for k in names]),
        (
            shapes["input_ids"],
            shapes["attention_mask"],
            *([tuple(shapes[k] for k in names)] if names else []),
        ),
        ["input_ids", "attention_mask", *names],
        [f"encoder_{name}" for name in traced.field_names] + [f"cross_{name}" for name in traced.kv_names],
        path,
        opset,
    )


def _export_step_graph(model, traced: _Traced, path: Path, opset: int | None) -> None:
    """The decoder step, traced with a past of length 3."""
    batch, src, past = _dims()
    sample, step_names, kv_names = traced.sample, traced.step_names, traced.kv_names
    field_values = [traced.encoder_outputs[name] for name in traced.field_names]
    past_kv = [t.new_zeros(t.shape[0], t.shape[1], 3, t.shape[3]).normal_() for kv in traced.self_kv for t in kv]
    cross = [t for kv in traced.cross_kv for t in kv]
    field_shapes = tuple(
        {0: batch, **{axis: src for axis, size in enumerate(value.shape) if axis and size == SAMPLE_SOURCE_LENGTH}}
        for value in field_values
    )
    _torch_export(
        StepGraph(model, step_names, traced.field_names, type(traced.encoder_outputs), traced.num_layers),
        (traced.start, sample["attention_mask"], *field_values, *[sample[k] for k in step_names], *past_kv, *cross),
        (
            {0: batch},
            {0: batch, 1: src},
            (
                *field_shapes,
                *[{0: batch} for _ in step_names],
                *[{0: batch, 2: past} for _ in past_kv],
                *[{0: batch, 2: src} for _ in cross],
            ),
        ),
        [
            "decoder_input_ids",
            "encoder_attention_mask",
            *[f"encoder_{n}" for n in traced.field_names],
            *step_names,
            *[f"past_{n}" for n in kv_names],
            *[f"cross_{n}" for n in kv_names],
        ],
        ["logits", *[f"present_{n}" for n in kv_names]],
        path,
        opset,
    )


def _export_shared_cache_graph(model, traced: _Traced, path: Path, opset: int | None) -> None:
    """The decoder step on shared buffers, traced on 4 rows (2 sentences x 2 beams: the sample's batch repeated,
    so that no axis of the sample has size 1), a capacity of 11 and 3 filled positions. The source padding
    (`encoder_attention_mask`) and the cross-attention keys/values come once per sentence (`sentences`: the
    indirection's first axis; rows = sentences x beam width), the other inputs once per row."""
    batch, src, _ = _dims()
    capacity = torch.export.Dim("capacity", min=2, max=4096)
    sentences, beams = torch.export.Dim("sentences", min=1, max=4096), torch.export.Dim("beams", min=1, max=4096)
    sample, step_names, kv_names = traced.sample, traced.step_names, traced.kv_names

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(2, dim=0)

    field_values = [rows(traced.encoder_outputs[name]) for name in traced.field_names]
    buffers = [t.new_zeros(2 * t.shape[0], t.shape[1], 11, t.shape[3]) for kv in traced.self_kv for t in kv]
    for buffer in buffers:
        buffer[:, :, :3].normal_()
    indirection = torch.randint(0, 2, (traced.start.shape[0], 2, 11), dtype=torch.int32)
    bookkeeping = [torch.tensor([3], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), indirection]
    cross = [t for kv in traced.cross_kv for t in kv]
    field_shapes = tuple(
        {0: batch, **{axis: src for axis, size in enumerate(value.shape) if axis and size == SAMPLE_SOURCE_LENGTH}}
        for value in field_values
    )
    _torch_export(
        SharedCacheStepGraph(model, step_names, traced.field_names, type(traced.encoder_outputs), traced.num_layers),
        (
            rows(traced.start),
            sample["attention_mask"],
            *field_values,
            *[rows(sample[k]) for k in step_names],
            *buffers,
            *bookkeeping,
            *cross,
        ),
        (
            {0: batch},
            {0: sentences, 1: src},
            (
                *field_shapes,
                *[{0: batch} for _ in step_names],
                *[{0: batch, 2: capacity} for _ in buffers],
                None,
                None,
                {0: sentences, 1: beams, 2: capacity},
                *[{0: sentences, 2: src} for _ in cross],
            ),
        ),
        [
            "decoder_input_ids",
            "encoder_attention_mask",
            *[f"encoder_{n}" for n in traced.field_names],
            *step_names,
            *[f"past_{n}" for n in kv_names],
            *SHARED_CACHE_INPUTS,
            *[f"cross_{n}" for n in kv_names],
        ],
        ["logits", *[f"present_{n}" for n in kv_names]],
        path,
        opset,
    )


def _export_scoring_graph(model, traced: _Traced, path: Path, opset: int | None) -> None:
    """The scoring graph (`ScoringGraph`), traced with targets of 5 tokens."""
    batch, src, _ = _dims()
    target = torch.export.Dim("target", min=1, max=4096)
    sample, names = traced.sample, traced.source_names
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(0, model.config.vocab_size, (sample["input_ids"].shape[0], 5), generator=generator)
    decoder_input_ids = torch.cat([traced.start, labels[:, :-1]], dim=1)
    source_shapes = {"tgt_lang_ids": {0: batch}, "phrase_index": {0: batch, 2: src}}
    _torch_export(
        ScoringGraph(model, names),
        (sample["input_ids"], sample["attention_mask"], decoder_input_ids, labels, *[sample[k] for k in names]),
        (
            {0: batch, 1: src},
            {0: batch, 1: src},
            {0: batch, 1: target},
            {0: batch, 1: target},
            *([tuple(source_shapes[k] for k in names)] if names else []),
        ),
        ["input_ids", "attention_mask", "decoder_input_ids", "labels", *names],
        ["token_log_probs"],
        path,
        opset,
    )
    _check_dynamic(path, config_name=model.config.model_type)
    io = _io(path)
    for value in io["inputs"]:
        if value["name"] in ("decoder_input_ids", "labels") and not all(isinstance(d, str) for d in value["shape"]):
            raise ValueError(
                f"export_onnx: {model.config.model_type}'s scoring graph fixed an axis of `{value['name']}` to "
                f"the sample's size ({value['shape']})."
            )


def _shared_cache_refusal(model, fusion: dict, enabled: bool) -> str | None:
    """Why no shared-cache step graph is written (None: it is): every decoder attention must be fused."""
    if not enabled:
        return "disabled (--no_shared_cache)"
    if not fusion["enabled"]:
        return "attention fusion disabled (--no_fuse_attention)"
    by_reason: dict[str, list[str]] = {}
    for name, why in unfused_decoder_attention(model).items():
        by_reason.setdefault(why, []).append(name)
    if by_reason:
        return "decoder attention not fused: " + "; ".join(
            f"{why} ({', '.join(names)})" for why, names in by_reason.items()
        )
    return None


def _shared_cache_record(model, staging: Path, num_layers: int, seconds: float) -> dict:
    """The manifest's `shared_cache` entry of a written shared-cache graph: its files, inputs/outputs, which outputs
    alias which inputs; the graph holds one DecoderMaskedMultiHeadAttention per decoder layer (checked: a module
    that fell back to the generic path while traced would not read the buffers)."""
    import onnx

    path = staging / SHARED_CACHE_FILES["fp32"]
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    found = sum(node.op_type == SHARED_CACHE_OP.split("::")[1] for node in nodes)
    if found != num_layers:
        raise RuntimeError(
            f"export_onnx: the shared-cache step graph of {model.config.model_type} holds {found} "
            f"DecoderMaskedMultiHeadAttention nodes, not one per cache layer ({num_layers})."
        )
    io = _io(path)
    return {
        "written": True,
        "op": SHARED_CACHE_OP,
        "graphs": {"fp32": SHARED_CACHE_FILES["fp32"]},
        "decoder": io,
        "aliases": {v["name"]: "past_" + v["name"][len("present_") :] for v in io["outputs"][1:]},
        "cross_attention": CROSS_PER_SENTENCE,
        "export_seconds": round(seconds, 2),
    }


def _quantize_graphs(
    staging: Path, weights: str, activations: str, shared: dict, scoring: dict, progress: bool
) -> tuple[dict, float, dict]:
    """int8 copies of every graph written (`quantize` with `weights` and `activations`), the shared-cache and
    scoring graphs' entries of `shared` and `scoring` completed: (the int8 source and step graph files, seconds, the
    manifest's `int8` record)."""
    started, rewritten = time.perf_counter(), {}
    names = list(zip(GRAPH_FILES["fp32"], GRAPH_FILES["int8"]))
    with _progress(progress, f"quantizing {', '.join(GRAPH_FILES['int8'])}"):
        for fp32_name, int8_name in names:
            rewritten[int8_name] = quantize(staging / fp32_name, staging / int8_name, weights, activations=activations)
    for record, files in ((shared, SHARED_CACHE_FILES), (scoring, SCORING_FILES)):
        if not record["written"]:
            continue
        quantize_started = time.perf_counter()
        with _progress(progress, f"quantizing {files['int8']}"):
            rewritten[files["int8"]] = quantize(
                staging / files["fp32"], staging / files["int8"], weights, activations=activations
            )
        record["graphs"]["int8"] = files["int8"]
        if record is shared:
            record["quantize_seconds"] = round(time.perf_counter() - quantize_started, 2)
    int8_record = dict(
        INT8_WEIGHTS[weights],
        weights=weights,
        activations=activations,
        op_types_to_quantize=QUANTIZED_OP_TYPES,
        split_stacked_matmuls={name: len(r["split"]) for name, r in rewritten.items()},
        per_tensor_matmuls=[m for r in rewritten.values() for m in r["per_tensor"]],
    )
    if activations == "per_row":  # per graph file: the activations quantized per row, the MatMuls reading them
        int8_record["per_row"] = {name: r["per_row"] for name, r in rewritten.items()}
        int8_record["opset"] = PER_ROW_OPSET
    files = {"encoder": GRAPH_FILES["int8"][0], "decoder": GRAPH_FILES["int8"][1]}
    return files, time.perf_counter() - started, int8_record


def _manifest(model, model_type: str, traced: _Traced, staging: Path, graphs: dict, seconds: dict, int8: dict):
    import onnx
    import onnxruntime
    import onnxscript

    files = GRAPH_FILES["fp32"]
    opset_used = next(
        o.version
        for o in onnx.load(str(staging / files[1]), load_external_data=False).opset_import
        if o.domain in ("", "ai.onnx")
    )
    return {
        "format": "hf_variants-onnx-seq2seq",
        "format_version": 1,
        "model_type": model_type,
        "graphs": graphs,
        "encoder": _io(staging / files[0]),
        "decoder": _io(staging / files[1]),
        "num_layers": traced.num_layers,
        "encoder_fields": traced.field_names,
        "source_inputs": traced.source_names,
        "step_inputs": traced.step_names,
        "tgt_lang_ids_required": _language_ids_required(model, traced.sample) if traced.step_names else False,
        "int8": dict(int8, quantizer=f"onnxruntime {onnxruntime.__version__}") if int8 else None,
        "exporter": {
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxscript": onnxscript.__version__,
            "dynamo": True,
            "opset": opset_used,
        },
        "export_seconds": round(seconds["export"], 2),
        "quantize_seconds": round(seconds["quantize"], 2) if int8 else None,
    }


def export(
    model,
    tokenizer,
    output_dir: str | Path,
    int8: bool = False,
    opset: int | None = None,
    force: bool = False,
    fuse_attention: bool = True,
    int8_weights: str = DEFAULT_INT8_WEIGHTS,
    shared_cache: bool = True,
    progress: bool = True,
    scoring: bool = False,
    int8_activations: str = DEFAULT_INT8_ACTIVATIONS,
    calibration_sources: list[str] | None = None,
    calibration_src_lang: str | None = None,
) -> Path:
    """Write `model` as an ONNX folder (see the module docstring): written into a staging folder, renamed when
    complete. Returns the folder. `fuse_attention`: every attention module that computes plain scaled dot-product
    attention becomes one `com.microsoft::MultiHeadAttention` node (`attention`); the others, and all of them
    with False, stay generic ONNX ops. The manifest's `attention_fusion` lists both, with the reasons.
    `int8_weights`: the int8 graphs' weight format, a key of `INT8_WEIGHTS`; `int8_activations`: how they quantize
    activations, "per_row" (default: a sentence's numbers do not depend on its batch) or "per_tensor" (one scale per
    call, over the batch; `quantization`'s module docstring) or "calibrated" (a fixed scale per activation from
    translating `calibration_sources`, in `calibration_src_lang` where the model marks the source language with a
    token; a Relu's output per row: `calibration`'s module docstring). `shared_cache`: also
    write the shared-cache step graph where every decoder attention is fused (the manifest's `shared_cache` says
    whether it was written, or why not). `progress`: one line on stderr per graph exported and per quantization
    ("exporting encoder_model.onnx ... done in 3.1 s"). `scoring`: also write the scoring graph (forced decoding of
    whole targets; the manifest's `scoring`)."""
    check_exportable(model, opset)
    calibration = _check_int8_arguments(
        model.config, int8, int8_weights, int8_activations, calibration_sources, calibration_src_lang
    )
    output_dir = Path(output_dir)
    check_not_an_input(output_dir, {"the model's folder": getattr(model, "name_or_path", None) or None})
    check_output_dir(output_dir, command=COMMAND, force=force)
    original_config = model.config
    model = copy.deepcopy(model).eval()  # the export unties the output projection of its own copy
    model.requires_grad_(False)  # a traced `scan` (MG-SA's phrase recurrence) would otherwise trace its backward
    implementation = model.config._attn_implementation
    if getattr(model.config, "max_relative_positions", 0):
        # torch 2.13's decomposition of SDPA with an additive (relative position) bias gives its output other strides
        # than the trace saw, and the export fails ("Cannot view a tensor ..."): the same math, traced eagerly
        implementation = "eager"
    elif implementation not in ("eager", "sdpa"):
        implementation = "sdpa"
    if implementation != model.config._attn_implementation:
        model.set_attn_implementation(implementation)
    started = time.perf_counter()
    traced = _trace(model)
    _untie_output_projection(model)
    fusion = _fuse(model, fuse_attention)

    staging = start_output_dir(output_dir, command=COMMAND, force=force)  # a failed export's leftover is removed
    files = GRAPH_FILES["fp32"]
    with _progress(progress, f"exporting {files[0]}"):
        _export_source_graph(model, traced, staging / files[0], opset)
    with _progress(progress, f"exporting {files[1]}"):
        _export_step_graph(model, traced, staging / files[1], opset)
    shared = {"written": False, "reason": _shared_cache_refusal(model, fusion, shared_cache)}
    if shared["reason"] is None:
        shared_started = time.perf_counter()
        with _progress(progress, f"exporting {SHARED_CACHE_FILES['fp32']}"):
            _export_shared_cache_graph(model, traced, staging / SHARED_CACHE_FILES["fp32"], opset)
        shared = _shared_cache_record(model, staging, traced.num_layers, time.perf_counter() - shared_started)
        files = (*files, SHARED_CACHE_FILES["fp32"])
    scoring_record = {"written": False, "reason": "not asked for (--scoring_graph)"}
    if scoring:
        scoring_started = time.perf_counter()
        with _progress(progress, f"exporting {SCORING_FILES['fp32']}"):
            _export_scoring_graph(model, traced, staging / SCORING_FILES["fp32"], opset)
        scoring_record = {
            "written": True,
            "graphs": {"fp32": SCORING_FILES["fp32"]},
            "io": _io(staging / SCORING_FILES["fp32"]),
            "export_seconds": round(time.perf_counter() - scoring_started, 2),
        }
    seconds = {"export": time.perf_counter() - started, "quantize": None}
    for name in files:
        _check_dynamic(staging / name, config_name=original_config.model_type)

    graphs, int8_record = {"fp32": {"encoder": files[0], "decoder": files[1]}}, None
    if int8:
        graphs["int8"], seconds["quantize"], int8_record = _quantize_graphs(
            staging, int8_weights, "per_row" if calibration else int8_activations, shared, scoring_record, progress
        )

    original_config.save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    manifest = _manifest(model, original_config.model_type, traced, staging, graphs, seconds, int8_record)
    manifest["attention_fusion"] = fusion
    manifest["shared_cache"] = shared
    manifest["scoring"] = scoring_record
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if calibration:
        _calibrate(staging, manifest, calibration, calibration_src_lang, progress)
    # the folder appears complete or not at all; --force replaces only a folder this export wrote
    return commit_output_dir(staging, output_dir, command=COMMAND, force=force)


def _check_int8_arguments(
    config, int8: bool, weights: str, activations: str, sources: list[str] | None, src_lang: str | None
) -> list[str] | None:
    """A ValueError naming the argument for an int8 weight format or activation scheme the export does not know, for
    the calibrated scheme without calibration sentences, or without the source language a model marking it with a
    token needs; returns the calibration sentences (the non-empty ones) where the scheme is calibrated, else None."""
    if weights not in INT8_WEIGHTS:
        raise ValueError(f"int8_weights={weights!r}: choose one of {sorted(INT8_WEIGHTS)}.")
    if activations not in INT8_ACTIVATIONS:
        raise ValueError(f"int8_activations={activations!r}: choose one of {list(INT8_ACTIVATIONS)}.")
    if not (int8 and activations == CALIBRATED):
        return None
    sentences = [text for text in sources or [] if text.strip()]
    if not sentences:
        raise ValueError(
            "int8_activations='calibrated' takes its scales from translating calibration sentences: pass "
            "calibration_sources (--calibration_data FILE, one source sentence per line)."
        )
    check_calibration_language(config, src_lang)
    return sentences


def _calibrate(staging: Path, manifest: dict, sentences: list[str], src_lang: str | None, progress: bool) -> None:
    """The staging folder's per-row int8 graphs, complete, translate `sentences`; then each graph gets their fixed
    scales (`calibration`), and the manifest (written again) says so."""
    started = time.perf_counter()
    with _progress(progress, f"calibrating the int8 activations on {len(sentences)} sentences"):
        counts = apply_calibration(staging, calibrate(staging, sentences, src_lang=src_lang))
    manifest["int8"].update(
        activations=CALIBRATED,
        calibration={
            "sentences": len(sentences),
            "src_lang": src_lang,
            "seconds": round(time.perf_counter() - started, 2),
        },
        calibrated=counts,
    )
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _fuse(model, enabled: bool) -> dict:
    """Route the model's qualifying attention modules through MultiHeadAttention (when `enabled`); the manifest's
    record: whether any is fused, which are (module names), and why the others are not."""
    if not enabled:
        return {"enabled": False, "applied": False, "reason": "disabled (--no_fuse_attention)"}
    modules = fuse_attention(model)
    record = {"enabled": True, "applied": bool(modules["fused"]), "op": "com.microsoft::MultiHeadAttention"}
    record.update(modules)
    if not modules["fused"]:
        record["reason"] = "no attention module qualifies: " + "; ".join(sorted(set(modules["generic"].values())))
    return record


def _language_ids_required(model, sample) -> bool:
    """Whether the model refuses to run without `tgt_lang_ids` (several languages with task-dependent weights)."""
    try:
        with torch.no_grad():
            model.get_encoder()(input_ids=sample["input_ids"], attention_mask=sample["attention_mask"])
            start = torch.full((sample["input_ids"].shape[0], 1), model.config.decoder_start_token_id)
            model(input_ids=sample["input_ids"], attention_mask=sample["attention_mask"], decoder_input_ids=start)
    except ValueError as error:
        if "tgt_lang_ids" in str(error):
            return True
        raise
    return False
