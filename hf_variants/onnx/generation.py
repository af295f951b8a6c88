"""The whole decoding loop inside ONNX Runtime: our two exported graphs wrapped in ORT's `com.microsoft::BeamSearch`
contrib op (T5 mode, `model_type=1`), so that greedy and beam search run without a Python step per token.

    model = OrtModelForSeq2SeqLM.from_pretrained(OUT)    # uses the op where it decodes as transformers does
    model.generate(**inputs, num_beams=1)                # greedy: bound on the shared-cache graph where the
                                                         # folder has one (onnx_bound), else in the op
    model.generate(**inputs, num_beams=4)                # beam, any early_stopping: bound on the shared-cache
                                                         # graph where the folder has one (onnx_bound); else
    model.generate(**inputs, num_beams=4, early_stopping=True)   # in the op (exact, see below); and
    model.generate(**inputs, num_beams=4)                # early_stopping=False: transformers' loop (the op where
                                                         # min_new_tokens == max_new_tokens), unless...
    model.generate(**inputs, num_beams=4, use_search_op=True)    # ...forced into the op (results may differ)
    model.generate(**inputs, use_search_op=False)        # always transformers' Python loop over the step graph

    python -m hf_variants.onnx_generation --model OUT [--precision int8] [--output search_model_int8.onnx]

`build_search_model(folder, precision)` composes the op's model from the exported folder (`export_onnx`) with the
`onnx` package:

- `encoder` subgraph (ORT's "encoder_decoder_init"): int32 `encoder_input_ids`, `encoder_attention_mask`,
  `decoder_input_ids` -> `logits` of the first step, `encoder_hidden_states`, `present_key_self_{i}` /
  `present_value_self_{i}` (one position) and `present_key_cross_{i}` / `present_value_cross_{i}`: the source graph
  followed by the step graph (its names prefixed `first_step/`) on an empty self-attention cache;
- `decoder` subgraph: the step graph with ORT's input/output names (`input_ids`, `encoder_attention_mask`,
  [`encoder_hidden_states`], `past_key_self_{i}`, ..., `past_key_cross_{i}`, ...; int32 ids cast to int64 inside).
  Encoder outputs the step does not read (the step reads the cached cross-attention keys/values) are dropped.

The op's inputs: `input_ids`, `max_length`, `min_length`, `num_beams`, `num_return_sequences`, `length_penalty`,
`repetition_penalty`, `vocab_mask` (1 = may be generated: the generation config's `suppress_tokens`, pad / bos /
decoder start for our models, are 0) and `attention_mask`; its attributes `eos_token_id`, `pad_token_id`,
`decoder_start_token_id`, `early_stopping` and `no_repeat_ngram_size` are fixed per model, so one op model is built
per (`early_stopping`, `no_repeat_ngram_size`) pair a call asks for, in memory, on first use (the exported folder stays
as the exporter wrote it, read-only folders work, and nothing can go stale when the graphs are re-exported or
re-quantized; building takes well under a second for the presets). `--output` writes one to a file: it runs on plain
onnxruntime, without hf_variants.

What the op takes (`search_op_settings`; anything else runs in transformers' loop, and
`model.last_decoding["reason"]` names what): greedy search (`num_beams=1`, no sampling) and beam search with
`length_penalty`, `early_stopping`, `num_return_sequences`, `max_length` / `max_new_tokens`, `min_length` /
`min_new_tokens` (eos suppressed while the sequence is shorter, as ORT's min_length does), `no_repeat_ngram_size`,
the model's token suppression (`suppress_tokens`, as `vocab_mask`); not sampling, other logits processors or
stopping criteria, `return_dict_in_generate` / scores, streamers, `use_cache=False`. MIMO's and Tied's target
language (`tgt_lang_ids`, one per sentence) is an input of the op's graph that its subgraphs read from the outer
scope; the decoder subgraph repeats it for the beams of each sentence.

Where the op's beam search differs from transformers' (`decode_with_search_op`): ORT scores a hypothesis that
reaches `max_length` by its length with the start token and admits every running beam at that step (transformers:
the generated length, the top `num_beams` candidates), so by default sentences where a returned hypothesis reached
`max_length` are decoded again in the loop (with `early_stopping=True` and `length_penalty >= 0` the others are
provably the same; where eos is suppressed up to `max_length`, as `min_new_tokens == max_new_tokens` asks, every
hypothesis has that length and the op's search is transformers' for every setting: `fixed_length`); and its
early-stop check for `early_stopping=False` compares the best of the step's
2 * num_beams candidates, read at offset `batch * num_beams` for every sentence (`BeamSearchScorer::Process`,
beam_search_scorer.cc), with the worst kept hypothesis, where transformers compares the best running beam, so that
setting takes the loop unless `use_search_op=True` or the length is fixed. Greedy search is the same in both.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

MANIFEST = "onnx_manifest.json"
SOURCE_PREFIX, FIRST_STEP_PREFIX, STEP_PREFIX = "source/", "first_step/", "step/"
# ONNX Runtime graph transformers our sessions leave out (`OrtModelForSeq2SeqLM.from_pretrained(disabled_optimizers=)`
# changes it): SkipLayerNormFusion. Its CPU kernel (onnxruntime 1.32) took 2.9-7.2x the time of the Add +
# LayerNormalization it replaces (one per sublayer: 9 per decoder step of the small model), and whole decodings
# ran 1.04-1.13x faster without it (small, 1 thread; `benchmarks/bench_ort_skip_layer_norm.py`)
DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)


def inference_session(model, options, providers, disabled_optimizers=DISABLED_OPTIMIZERS):
    """An `onnxruntime.InferenceSession` on `model` (a path or a serialized model) with ONNX Runtime's graph
    transformers named in `disabled_optimizers` left out."""
    import onnxruntime

    return onnxruntime.InferenceSession(
        model, sess_options=options, providers=providers, disabled_optimizers=list(disabled_optimizers)
    )


def _load(folder: Path, precision: str):
    import onnx

    manifest = json.loads((folder / MANIFEST).read_text())
    if precision not in manifest["graphs"]:
        raise ValueError(f"precision={precision!r}: {folder} has graphs for {sorted(manifest['graphs'])}.")
    files = manifest["graphs"][precision]
    return manifest, onnx.load(str(folder / files["encoder"])), onnx.load(str(folder / files["decoder"]))


def _consumed(graph) -> set[str]:
    """Every value name a node of `graph` (or of a subgraph in it) reads."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for attribute in node.attribute:
            if attribute.HasField("g"):
                names |= _consumed(attribute.g)
            for sub in attribute.graphs:
                names |= _consumed(sub)
    return names


def search_op_refusal(manifest: dict, step_graph=None) -> str | None:
    """Why the model type cannot run in the BeamSearch op (None when it can): an input beside the source and the
    target language (MG-SA's phrase inputs, refused by the exporter anyway), or an encoder output beside the hidden
    states that the step graph reads (ORT passes the decoder only `encoder_hidden_states`)."""
    other = sorted((set(manifest["step_inputs"]) | set(manifest["source_inputs"])) - {"tgt_lang_ids"})
    if other:
        return f"{manifest['model_type']} reads {other} besides the source and tgt_lang_ids"
    if step_graph is not None:
        used = _consumed(step_graph)
        extra = [f for f in manifest["encoder_fields"] if f != "last_hidden_state" and f"encoder_{f}" in used]
        if extra:
            return f"its step graph reads encoder outputs {extra}; ORT's BeamSearch passes only encoder_hidden_states"
    return None


def _prefixed(model, prefix: str):
    """A copy of `model` with `prefix` before every value and node name, in its subgraphs too (a Scan body's
    references to the outer graph included, which `onnx.compose.add_prefix` leaves unprefixed). Local functions
    keep their names (their bodies have their own scope)."""

    def name(value: str) -> str:
        return prefix + value if value else value

    def visit(graph) -> None:
        for node in graph.node:
            node.name = name(node.name)
            node.input[:] = [name(x) for x in node.input]
            node.output[:] = [name(x) for x in node.output]
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    visit(attribute.g)
                for sub in attribute.graphs:
                    visit(sub)
        for value in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]:
            value.name = name(value.name)
        for sparse in graph.sparse_initializer:
            sparse.values.name = name(sparse.values.name)

    model = copy.deepcopy(model)
    visit(model.graph)
    return model


def _value_info(name: str, elem_type: int, shape: list):
    import onnx

    return onnx.helper.make_tensor_value_info(name, elem_type, shape)


def _output_info(graph, name: str):
    return next(v for v in graph.output if v.name == name)


def _renamed_info(info, name: str):
    renamed = copy.deepcopy(info)
    renamed.name = name
    return renamed


def _encoder_subgraph(manifest: dict, source, step):
    """Source graph + the first decoder step (from `decoder_input_ids`, on an empty cache) as ORT's
    encoder_decoder_init subgraph. Both graphs' names are prefixed (`source/`, `first_step/`): a subgraph may not
    redefine a name of the op's graph (`input_ids`, `attention_mask`)."""
    from onnx import TensorProto, helper

    n, src, first = manifest["num_layers"], SOURCE_PREFIX, FIRST_STEP_PREFIX
    source, step = _prefixed(source, src), _prefixed(step, first)
    int64 = TensorProto.INT64
    head = [
        helper.make_node("Cast", ["encoder_input_ids"], [f"{src}input_ids"], to=int64),
        helper.make_node("Cast", ["encoder_attention_mask"], [f"{src}attention_mask"], to=int64),
        helper.make_node("Cast", ["decoder_input_ids"], [f"{first}decoder_input_ids"], to=int64),
        helper.make_node("Identity", [f"{src}attention_mask"], [f"{first}encoder_attention_mask"]),
    ]
    middle = [
        helper.make_node("Constant", [], ["empty_past_bound"], value=helper.make_tensor("b", int64, [1], [0])),
        helper.make_node("Constant", [], ["empty_past_axis"], value=helper.make_tensor("a", int64, [1], [2])),
    ]
    if manifest["source_inputs"]:  # the target language: the op graph's input, read from the outer scope
        head.append(helper.make_node("Identity", ["tgt_lang_ids"], [f"{src}tgt_lang_ids"]))
    if manifest["step_inputs"]:
        head.append(helper.make_node("Identity", ["tgt_lang_ids"], [f"{first}tgt_lang_ids"]))
    for name in manifest["encoder_fields"]:
        middle.append(helper.make_node("Identity", [f"{src}encoder_{name}"], [f"{first}encoder_{name}"]))
    for i in range(n):
        for kind in ("key", "value"):
            cross = f"cross_{kind}.{i}"
            middle.append(helper.make_node("Identity", [f"{src}{cross}"], [f"{first}{cross}"]))
            # an empty self-attention cache [batch, heads, 0, head_dim]: the cross keys/values cut to length 0
            middle.append(
                helper.make_node(
                    "Slice",
                    [f"{src}{cross}", "empty_past_bound", "empty_past_bound", "empty_past_axis"],
                    [f"{first}past_{kind}.{i}"],
                )
            )
    # ORT reads output 1 as the encoder hidden states whether the decoder subgraph takes them or not
    outputs_map = [("logits", f"{first}logits"), ("encoder_hidden_states", f"{src}encoder_last_hidden_state")]
    outputs_map += [
        (f"present_{kind}_self_{i}", f"{first}present_{kind}.{i}") for i in range(n) for kind in ("key", "value")
    ]
    outputs_map += [
        (f"present_{kind}_cross_{i}", f"{src}cross_{kind}.{i}") for i in range(n) for kind in ("key", "value")
    ]
    infos = {v.name: v for v in list(source.graph.output) + list(step.graph.output)}
    tail = [helper.make_node("Identity", [old], [new]) for new, old in outputs_map]
    outputs = [_renamed_info(infos[old], new) for new, old in outputs_map]
    source_ids = next(v for v in source.graph.input if v.name == f"{src}input_ids")
    batch, length = (d.dim_param or d.dim_value for d in source_ids.type.tensor_type.shape.dim)
    graph = helper.make_graph(
        head + list(source.graph.node) + middle + list(step.graph.node) + tail,
        "hf_variants encoder and first decoder step",
        [
            _value_info("encoder_input_ids", TensorProto.INT32, [batch, length]),
            _value_info("encoder_attention_mask", TensorProto.INT32, [batch, length]),
            _value_info("decoder_input_ids", TensorProto.INT32, [batch, 1]),
        ],
        outputs,
        initializer=list(source.graph.initializer) + list(step.graph.initializer),
        value_info=list(source.graph.value_info) + list(step.graph.value_info),
    )
    return graph, list(source.functions) + list(step.functions)


def _decoder_subgraph(manifest: dict, step, uses_hidden: bool):
    """The step graph (names prefixed `step/`) under ORT's T5 decoder names, int32 ids cast inside."""
    from onnx import TensorProto, helper

    n, pre = manifest["num_layers"], STEP_PREFIX
    step = _prefixed(step, pre)
    inputs = {v.name: v for v in step.graph.input}
    ids, mask = inputs[f"{pre}decoder_input_ids"], inputs[f"{pre}encoder_attention_mask"]
    batch = ids.type.tensor_type.shape.dim[0].dim_param or ids.type.tensor_type.shape.dim[0].dim_value
    source = mask.type.tensor_type.shape.dim[1].dim_param or mask.type.tensor_type.shape.dim[1].dim_value
    int64 = TensorProto.INT64
    head = [
        helper.make_node("Cast", ["input_ids"], [f"{pre}decoder_input_ids"], to=int64),
        helper.make_node("Cast", ["encoder_attention_mask"], [f"{pre}encoder_attention_mask"], to=int64),
    ]
    new_inputs = [
        _value_info("input_ids", TensorProto.INT32, [batch, 1]),
        _value_info("encoder_attention_mask", TensorProto.INT32, [batch, source]),
    ]
    if manifest["step_inputs"]:
        # the target language of each row: the op graph's `tgt_lang_ids` [batch] (outer scope) repeated for the
        # beams of its sentence (rows / batch of them), as generate() repeats it
        head += [
            helper.make_node("Shape", ["input_ids"], ["tgt_lang_rows"], start=0, end=1),
            helper.make_node("Shape", ["tgt_lang_ids"], ["tgt_lang_batch"]),
            helper.make_node("Div", ["tgt_lang_rows", "tgt_lang_batch"], ["tgt_lang_beams"]),
            helper.make_node("Concat", ["tgt_lang_batch", "tgt_lang_beams"], ["tgt_lang_grid"], axis=0),
            helper.make_node("Constant", [], ["tgt_lang_axis"], value=helper.make_tensor("a", int64, [1], [1])),
            helper.make_node("Unsqueeze", ["tgt_lang_ids", "tgt_lang_axis"], ["tgt_lang_column"]),
            helper.make_node("Expand", ["tgt_lang_column", "tgt_lang_grid"], ["tgt_lang_expanded"]),
            helper.make_node("Constant", [], ["tgt_lang_flat"], value=helper.make_tensor("f", int64, [1], [-1])),
            helper.make_node("Reshape", ["tgt_lang_expanded", "tgt_lang_flat"], [f"{pre}tgt_lang_ids"]),
        ]
    if uses_hidden:
        new_inputs.append(_renamed_info(inputs[f"{pre}encoder_last_hidden_state"], "encoder_hidden_states"))
        head.append(helper.make_node("Identity", ["encoder_hidden_states"], [f"{pre}encoder_last_hidden_state"]))
    for group, ort_group in (("past", "self"), ("cross", "cross")):
        for i in range(n):
            for kind in ("key", "value"):
                name, new = f"{pre}{group}_{kind}.{i}", f"past_{kind}_{ort_group}_{i}"
                new_inputs.append(_renamed_info(inputs[name], new))
                head.append(helper.make_node("Identity", [new], [name]))
    outputs_map = [("logits", f"{pre}logits")]
    outputs_map += [(f"present_{k}_self_{i}", f"{pre}present_{k}.{i}") for i in range(n) for k in ("key", "value")]
    tail = [helper.make_node("Identity", [old], [new]) for new, old in outputs_map]
    outputs = [_renamed_info(_output_info(step.graph, old), new) for new, old in outputs_map]
    graph = helper.make_graph(
        head + list(step.graph.node) + tail,
        "hf_variants decoder step",
        new_inputs,
        outputs,
        initializer=list(step.graph.initializer),
        value_info=list(step.graph.value_info),
    )
    return graph, list(step.functions)


def build_search_model(
    folder: str | Path,
    precision: str = "fp32",
    early_stopping: bool = False,
    no_repeat_ngram_size: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    decoder_start_token_id: int | None = None,
):
    """The BeamSearch op's model (an `onnx.ModelProto`) for the exported `folder` (see the module docstring); the
    token ids default to the folder's config. Raises a ValueError naming what the op cannot take
    (`search_op_refusal`)."""
    from onnx import TensorProto, helper

    folder = Path(folder)
    manifest, source, step = _load(folder, precision)
    refusal = search_op_refusal(manifest, step.graph)
    if refusal:
        raise ValueError(f"{folder}: the BeamSearch op cannot run this model: {refusal}.")
    config = json.loads((folder / "config.json").read_text())
    uses_hidden = "encoder_last_hidden_state" in _consumed(step.graph)
    encoder, encoder_functions = _encoder_subgraph(manifest, source, step)
    decoder, decoder_functions = _decoder_subgraph(manifest, step, uses_hidden)
    vocab_size = config["vocab_size"]
    node = helper.make_node(
        "BeamSearch",
        [
            "input_ids",
            "max_length",
            "min_length",
            "num_beams",
            "num_return_sequences",
            "length_penalty",
            "repetition_penalty",
            "vocab_mask",
            "",
            "attention_mask",
        ],
        ["sequences"],
        name="BeamSearch_hf_variants",
        domain="com.microsoft",
        eos_token_id=config["eos_token_id"] if eos_token_id is None else eos_token_id,
        pad_token_id=config["pad_token_id"] if pad_token_id is None else pad_token_id,
        decoder_start_token_id=config["decoder_start_token_id"]
        if decoder_start_token_id is None
        else decoder_start_token_id,
        no_repeat_ngram_size=int(no_repeat_ngram_size),
        early_stopping=int(bool(early_stopping)),
        model_type=1,
        vocab_size=vocab_size,
        encoder=encoder,
        decoder=decoder,
    )
    scalar = [1]
    graph = helper.make_graph(
        [node],
        "hf_variants beam search",
        [
            _value_info("input_ids", TensorProto.INT32, ["batch_size", "sequence_length"]),
            _value_info("max_length", TensorProto.INT32, scalar),
            _value_info("min_length", TensorProto.INT32, scalar),
            _value_info("num_beams", TensorProto.INT32, scalar),
            _value_info("num_return_sequences", TensorProto.INT32, scalar),
            _value_info("length_penalty", TensorProto.FLOAT, scalar),
            _value_info("repetition_penalty", TensorProto.FLOAT, scalar),
            _value_info("vocab_mask", TensorProto.INT32, [vocab_size]),
            _value_info("attention_mask", TensorProto.INT32, ["batch_size", "sequence_length"]),
            *([_value_info("tgt_lang_ids", TensorProto.INT64, ["batch_size"])] if manifest["source_inputs"] else []),
        ],
        [_value_info("sequences", TensorProto.INT32, ["batch_size", "num_return_sequences", "max_length"])],
    )
    opsets = {o.domain: o.version for o in list(step.opset_import) + list(source.opset_import)}
    opsets.setdefault("com.microsoft", 1)
    model = helper.make_model(
        graph,
        producer_name="hf_variants.onnx_generation",
        opset_imports=[helper.make_opsetid(domain, version) for domain, version in opsets.items()],
        functions=encoder_functions + decoder_functions,
    )
    model.ir_version = max(source.ir_version, step.ir_version)
    return model


# ---------------------------------------------------------------------------------------------------- runtime
class SearchOpRefused(Exception):
    """The requested decoding does not fit the BeamSearch op (the message says what); generate() takes the loop."""


_ALLOWED_MODEL_KWARGS = {"encoder_outputs", "attention_mask", "use_cache", "past_key_values", "tgt_lang_ids"}


def _processor_settings(logits_processor, vocab_size: int, eos: int) -> tuple[set, int, int]:
    """What the logits processors of a `generate()` call do, as the op's settings: (token ids never generated, the
    length before which eos is suppressed, no_repeat_ngram_size). Raises SearchOpRefused for anything else."""
    from transformers.generation.logits_process import (
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        SuppressTokensLogitsProcessor,
    )

    from ..generation_transformer_nmt import TokenSuppressionLogitsProcessor

    suppressed, min_length, ngram = set(), 0, 0
    rules = []
    for processor in logits_processor:
        if type(processor) is TokenSuppressionLogitsProcessor:
            rules += [(ids.tolist(), length) for ids, length in processor.rules]
        elif type(processor) is SuppressTokensLogitsProcessor:
            rules.append((processor.suppress_tokens.reshape(-1).tolist(), None))
        elif type(processor) is MinLengthLogitsProcessor:
            rules.append((processor.eos_token_id.reshape(-1).tolist(), processor.min_length))
        elif type(processor) is MinNewTokensLengthLogitsProcessor:
            length = processor.prompt_length_to_skip + processor.min_new_tokens
            rules.append((processor.eos_token_id.reshape(-1).tolist(), length))
        elif type(processor) is NoRepeatNGramLogitsProcessor:
            ngram = processor.ngram_size
        else:
            raise SearchOpRefused(f"the logits processor {type(processor).__name__}")
    for ids, length in rules:
        ids = [i for i in ids if 0 <= i < vocab_size]
        if length is None:
            suppressed.update(ids)
        elif set(ids) <= {eos}:
            min_length = max(min_length, int(length))  # eos suppressed while the sequence is shorter: ORT's rule
        else:
            raise SearchOpRefused(f"tokens {ids} suppressed up to a length (the op suppresses only eos so)")
    return suppressed, min_length, ngram


def search_op_settings(model, input_ids, logits_processor, stopping_criteria, generation_config, mode, model_kwargs):
    """The op's inputs and attributes for a `generate()` call that transformers prepared (`mode` "greedy" from
    `_sample`, "beam" from `_beam_search`): what its logits processors and stopping criteria do, mapped to the op.
    Raises SearchOpRefused naming the first thing the op cannot do."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    config = generation_config
    if config.do_sample:
        raise SearchOpRefused("sampling (do_sample=True)" if mode == "greedy" else "beam sampling (do_sample=True)")
    if model_kwargs.get("use_cache") is False:
        raise SearchOpRefused("use_cache=False (every step recomputed: the loop)")
    for flag in ("return_dict_in_generate", "output_scores", "output_logits"):
        if getattr(config, flag, False):
            raise SearchOpRefused(f"{flag}=True (the op returns the sequences only)")
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _ALLOWED_MODEL_KWARGS)
    if extra:
        raise SearchOpRefused(f"model inputs {extra} (the op's subgraphs take the source and tgt_lang_ids)")
    if input_ids.shape[1] != 1:
        raise SearchOpRefused(f"a decoder prompt of {input_ids.shape[1]} tokens (the op starts from one start token)")
    eos = config._eos_token_tensor
    if eos is None or eos.numel() != 1:
        raise SearchOpRefused(f"eos_token_id={config.eos_token_id} (the op takes exactly one end token)")
    eos = int(eos.reshape(-1)[0])
    vocab_size = model.config.vocab_size
    suppressed, min_length, ngram = _processor_settings(logits_processor, vocab_size, eos)
    for criterion in stopping_criteria:
        if type(criterion) is EosTokenCriteria and criterion.eos_token_id.reshape(-1).tolist() == [eos]:
            continue
        if type(criterion) is not MaxLengthCriteria:
            raise SearchOpRefused(f"the stopping criterion {type(criterion).__name__}")
    if mode == "beam":
        if config.early_stopping not in (True, False, "never"):
            raise SearchOpRefused(
                f"early_stopping={config.early_stopping!r} (transformers takes True, False, 'never')"
            )
        num_beams, returned = config.num_beams, config.num_return_sequences or 1
        length_penalty, early_stopping = float(config.length_penalty), bool(config.early_stopping)
        fill = config._pad_token_tensor  # transformers' beam search pads with pad_token_id, or eos when that is 0
        fill = int(fill) if fill is not None and int(fill) else eos
    else:
        if input_ids.shape[0] != model_kwargs["attention_mask"].shape[0] or (config.num_return_sequences or 1) > 1:
            raise SearchOpRefused("several sequences per source with greedy search")
        num_beams, returned, length_penalty, early_stopping = 1, 1, 1.0, True
        fill = config._pad_token_tensor
        fill = int(fill) if fill is not None else eos
    pad = config._pad_token_tensor
    pad = int(pad) if pad is not None else None
    mask = [1] * vocab_size
    for i in suppressed:
        mask[i] = 0
    return {
        "inputs": {
            "max_length": config.max_length,
            "min_length": min_length,
            "num_beams": num_beams,
            "num_return_sequences": returned,
            "length_penalty": length_penalty,
            "vocab_mask": mask,
        },
        "attributes": {
            "early_stopping": early_stopping,
            "no_repeat_ngram_size": ngram,
            "eos_token_id": eos,
            # the op feeds this id to finished sentences and pads its output with it, which marks where each
            # hypothesis ended (the op drops the eos): the pad id where it is never generated (suppressed), as
            # transformers' greedy search feeds it (int8 graphs quantize activations per batch: the same feeds
            # give the same scales), else eos (which a kept hypothesis never holds)
            "pad_token_id": pad if pad is not None and pad in suppressed else eos,
            "decoder_start_token_id": int(input_ids[0, 0]),
        },
        "fill": fill,
        "expand": num_beams if mode == "beam" else 1,
    }


class SearchOpRunner:
    """The BeamSearch op sessions of one `OrtModelForSeq2SeqLM` (one per precision and attribute set, built on
    first use) and the conversion of its output to transformers' `generate()` output."""

    def __init__(
        self,
        folder: Path,
        precision: str,
        session_options=None,
        providers=None,
        disabled_optimizers=DISABLED_OPTIMIZERS,
    ):
        self.folder, self.precision = Path(folder), precision
        self.session_options, self.providers = session_options, providers or ["CPUExecutionProvider"]
        self.disabled_optimizers = disabled_optimizers
        self.sessions = {}

    def session(self, attributes: dict):
        key = tuple(sorted(attributes.items()))
        if key not in self.sessions:
            model = build_search_model(self.folder, self.precision, **attributes)
            self.sessions[key] = inference_session(
                model.SerializeToString(), self.session_options, self.providers, self.disabled_optimizers
            )
        return self.sessions[key]

    def run(self, source_ids, attention_mask, settings: dict, tgt_lang_ids=None):
        """sequences [batch * num_return_sequences, length] as transformers returns them (the start token, the
        tokens, eos where a hypothesis ended, then the fill id `settings["fill"]`, cut to the longest), each row's
        length, and whether it ended with eos."""
        import numpy as np

        inputs = settings["inputs"]
        feeds = {
            "input_ids": source_ids.numpy().astype(np.int32),
            "attention_mask": attention_mask.numpy().astype(np.int32),
            "max_length": np.array([inputs["max_length"]], np.int32),
            "min_length": np.array([inputs["min_length"]], np.int32),
            "num_beams": np.array([inputs["num_beams"]], np.int32),
            "num_return_sequences": np.array([inputs["num_return_sequences"]], np.int32),
            "length_penalty": np.array([inputs["length_penalty"]], np.float32),
            "repetition_penalty": np.array([1.0], np.float32),
            "vocab_mask": np.array(inputs["vocab_mask"], np.int32),
        }
        if tgt_lang_ids is not None:
            feeds["tgt_lang_ids"] = tgt_lang_ids.numpy().astype(np.int64)
        (sequences,) = self.session(settings["attributes"]).run(None, feeds)
        sequences = torch.from_numpy(sequences.reshape(-1, sequences.shape[-1]).astype(np.int64))
        attributes = settings["attributes"]
        ends = sequences[:, 1:] == attributes["pad_token_id"]
        ended = ends.any(1)
        # a hypothesis that ended with eos is followed by the op's padding: eos goes where that starts
        first = ends.int().argmax(1) + 1
        rows = ended.nonzero().reshape(-1)
        sequences[rows, first[rows]] = attributes["eos_token_id"]
        lengths = torch.where(ended, first + 1, sequences.shape[1])
        positions = torch.arange(sequences.shape[1])
        sequences = sequences.masked_fill(positions[None, :] >= lengths[:, None], settings["fill"])
        return sequences[:, : int(lengths.max())], lengths, ended


def _rows(value, rows: torch.Tensor):
    """`value` (a tensor, a ModelOutput of tensors, or anything else, kept) restricted to batch rows `rows`."""
    if isinstance(value, torch.Tensor):
        return value[rows]
    if isinstance(value, dict):  # a ModelOutput (OrtEncoderOutput: keys beyond its fields, set as items)
        restricted = type(value)()
        for key, item in value.items():
            restricted[key] = _rows(item, rows)
        return restricted
    return value


def defer_encoder(model, generation_config, model_input_name, model_kwargs: dict) -> bool:
    """Whether generate() may leave the source graph to the op or the bound search (called before it would run
    it): a call that asks for greedy or beam search, nothing the op cannot return, and no encoder input but the
    mask, on a model the op takes. `decode_with_search_op` decides per call; where it then declines, the loop
    computes the encoder outputs (`with_encoder_outputs`)."""
    from transformers.generation.configuration_utils import GenerationMode

    config = generation_config
    return (
        model.search_op_mode() != "never"
        and not model.search_op_refusal
        and model_input_name == "input_ids"
        and config.get_generation_mode() in (GenerationMode.GREEDY_SEARCH, GenerationMode.BEAM_SEARCH)
        and not any(
            getattr(config, flag, False)
            for flag in ("return_dict_in_generate", "output_attentions", "output_hidden_states", "output_scores")
        )
        and all(v is None or k in ("attention_mask", "use_cache", "tgt_lang_ids") for k, v in model_kwargs.items())
    )


def with_encoder_outputs(model, inputs_tensor, expand: int, model_kwargs: dict) -> dict:
    """`model_kwargs` with the encoder outputs generate() left to the op (an empty placeholder) computed, repeated
    `expand` times per sentence as generate() repeats them."""
    encoder_outputs = model_kwargs.get("encoder_outputs")
    if encoder_outputs is None or encoder_outputs.last_hidden_state is not None:
        return model_kwargs
    mask, tgt_lang_ids = model_kwargs.get("attention_mask"), model_kwargs.get("tgt_lang_ids")
    encoded = model.encode(
        inputs_tensor,
        mask[::expand] if mask is not None else None,
        tgt_lang_ids=tgt_lang_ids[::expand] if tgt_lang_ids is not None else None,
    )
    for key, value in encoded.items():
        encoded[key] = value.repeat_interleave(expand, dim=0) if expand > 1 else value
    return dict(model_kwargs, encoder_outputs=encoded)


def _pad_to(sequences: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    if sequences.shape[1] >= length:
        return sequences
    return torch.cat([sequences, sequences.new_full((sequences.shape[0], length - sequences.shape[1]), fill)], 1)


def fixed_length(settings: dict) -> bool:
    """Whether eos stays suppressed up to `max_length` (`min_length >= max_length`, as `min_new_tokens ==
    max_new_tokens` asks), so that every hypothesis has `max_length` tokens. Then the op's beam search is exactly
    transformers' for every `early_stopping` and `length_penalty`: no hypothesis finishes before the last step, so
    neither early-stop check can fire (both need `num_beams` finished hypotheses of a sentence), and at the last step
    both return the best running beams by summed log-probability (equal lengths: the two length terms, with or
    without the start token, scale every hypothesis of a sentence alike)."""
    return settings["inputs"]["min_length"] >= settings["inputs"]["max_length"]


def bound_search(model, mode: str, policy: str, settings: dict) -> bool:
    """Whether a greedy or beam search the op would run goes to `OrtModelForSeq2SeqLM.shared_cache_search` instead
    (the shared-cache graph's inputs and outputs bound once, `onnx_bound`: 1.08-1.39x the op's tok/s greedy, 1.10-1.20x
    beam 4, small dims, 1 thread; beam search with transformers' own bookkeeping, so exact for every `early_stopping`):
    the default
    policy ("exact"; `use_search_op=True` keeps the op), a folder with the shared-cache step graph, and no
    no_repeat_ngram_size."""
    return (
        policy == "exact"
        and model.shared_cache_graph is not None
        and not settings["attributes"]["no_repeat_ngram_size"]
    )


def op_refusal(mode: str, policy: str, settings: dict, generation_config) -> str | None:
    """Why the op does not run a beam search transformers' settings ask for, or None: early_stopping="never" (the
    op takes True or False), and under the "exact" policy the settings where its results may differ from
    transformers' (`decode_with_search_op`)."""
    if mode != "beam":
        return None
    if generation_config.early_stopping == "never":
        return "early_stopping='never' (the op takes True or False)"
    if policy != "exact" or fixed_length(settings):
        return None
    if generation_config.early_stopping is not True:
        return (
            f"beam search with early_stopping={generation_config.early_stopping!r}: ORT's early-stop check differs "
            "from transformers' (use_search_op=True takes the op anyway)"
        )
    if generation_config.length_penalty < 0:
        return "beam search with a negative length_penalty (use_search_op=True takes the op anyway)"
    return None


def decode_with_search_op(
    model, mode, input_ids, generation_config, loop, inputs_tensor, logits_processor, stopping_criteria, **kwargs
):
    """The sequences of one `generate()` decoding: where the call fits the op's settings, under the default policy on
    a folder with the shared-cache graph through `model.shared_cache_search` (greedy and beam search bound on that
    graph, `bound_search`: exact for every `early_stopping`), else through the BeamSearch op where `op_refusal`
    allows; else through `loop` (transformers' decoding method); `model.last_decoding` records the path taken and
    why. The policies below are the op's.

    `model.search_op_mode()`: "never"; "exact" (the default): greedy search, beam search where no hypothesis can
    end before `max_length` (`fixed_length`: any `early_stopping`, any `length_penalty`), and beam search with
    `early_stopping=True` and `length_penalty >= 0`, whose results equal transformers' (sentences where a returned
    hypothesis reached `max_length` are decoded again by `loop`, transformers' decoding method: ORT scores such a
    hypothesis by its length with the start token and admits every running beam at that step, transformers by its
    generated length and only the top `num_beams` candidates); "always": also beam search with
    `early_stopping=False`, whose early-stop check differs from transformers' (ORT compares the best of the step's
    2 * num_beams candidates, read at offset `batch * num_beams` for every sentence of the batch, with the worst kept
    hypothesis; transformers the best running beam), so its results may differ on some sentences."""
    model_kwargs = dict(kwargs)
    streamer = model_kwargs.pop("streamer", None)
    synced_gpus = model_kwargs.pop("synced_gpus", False)
    policy, reason, settings = model.search_op_mode(), None, None
    if policy == "never":
        reason = "use_search_op=False"
    elif model.search_op_refusal:
        reason = model.search_op_refusal
    elif streamer is not None or synced_gpus:
        reason = "a streamer" if streamer is not None else "synced_gpus"
    elif inputs_tensor is None or inputs_tensor.dtype not in (torch.long, torch.int32):
        reason = "no source input_ids (inputs_embeds)"
    if reason is None:
        try:
            settings = search_op_settings(
                model, input_ids, logits_processor, stopping_criteria, generation_config, mode, model_kwargs
            )
        except SearchOpRefused as refused:
            reason = str(refused)
    bound = settings is not None and bound_search(model, mode, policy, settings)
    if settings is not None and not bound:
        reason = op_refusal(mode, policy, settings, generation_config)
    if reason is not None:
        settings = None
    expand = input_ids.shape[0] // inputs_tensor.shape[0] if inputs_tensor is not None else 1
    if settings is None:
        model.last_decoding = {"path": "python_loop", "reason": reason}
        logger.info("generate(): transformers' decoding loop (%s)", reason)
        return loop(input_ids, **with_encoder_outputs(model, inputs_tensor, expand, kwargs))
    mask = model_kwargs.get("attention_mask")
    mask = mask[::expand] if mask is not None else torch.ones_like(inputs_tensor)
    if bound:
        sequences = model.shared_cache_search(
            mode, inputs_tensor, mask, settings, model_kwargs.get("tgt_lang_ids"), generation_config.early_stopping
        )
        model.last_decoding = {
            "path": f"shared_cache_{mode}",
            "reason": f"{mode} search on the shared-cache step graph, inputs and outputs bound once",
        }
        logger.info("generate(): %s", model.last_decoding["reason"])
        return sequences
    tgt_lang_ids = None
    if "tgt_lang_ids" in model.manifest["source_inputs"]:
        tgt_lang_ids = model_kwargs.get("tgt_lang_ids")
        batch = inputs_tensor.shape[0]
        tgt_lang_ids = (
            tgt_lang_ids[::expand] if tgt_lang_ids is not None else model._default_input("tgt_lang_ids", batch)
        )
    try:
        sequences, lengths, ended = model.search_op_runner().run(inputs_tensor, mask, settings, tgt_lang_ids)
    except (ValueError, OSError, ImportError) as error:  # the builder's refusal, the folder gone, no onnx package
        model.search_op_refusal = str(error)
        model.last_decoding = {"path": "python_loop", "reason": str(error)}
        return loop(input_ids, **with_encoder_outputs(model, inputs_tensor, expand, kwargs))
    model.last_decoding = {"path": "search_op", "reason": f"{mode} search in com.microsoft::BeamSearch"}
    returned = settings["inputs"]["num_return_sequences"]
    checked_beam = mode == "beam" and policy == "exact" and not fixed_length(settings)
    redo = ~ended.reshape(-1, returned).all(1) if checked_beam else ended[:0]
    if redo.any():
        sentences = redo.nonzero().reshape(-1)
        rows = (sentences[:, None] * expand + torch.arange(expand)[None, :]).reshape(-1)
        model_kwargs = with_encoder_outputs(model, inputs_tensor, expand, model_kwargs)
        again = loop(input_ids[rows], **{k: _rows(v, rows) for k, v in model_kwargs.items()})
        out_rows = (sentences[:, None] * returned + torch.arange(returned)[None, :]).reshape(-1)
        kept = torch.ones(sequences.shape[0], dtype=torch.bool)
        kept[out_rows] = False
        length = max([again.shape[1]] + lengths[kept].tolist())  # transformers' width: the longest row
        sequences = _pad_to(sequences, length, settings["fill"])[:, :length]
        sequences[out_rows] = _pad_to(again, length, settings["fill"])
        model.last_decoding["redecoded"] = sentences.tolist()
        model.last_decoding["reason"] += (
            f"; {len(sentences)} sentence(s) reaching max_length decoded again in transformers' loop"
        )
    logger.info("generate(): %s", model.last_decoding["reason"])
    return sequences


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a folder written by `python -m hf_variants.export_onnx`")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "int8"])
    parser.add_argument("--output", help="the .onnx file (default: MODEL/search_model[_int8].onnx)")
    parser.add_argument("--early_stopping", action="store_true", help="the op's early_stopping attribute")
    parser.add_argument("--no_repeat_ngram_size", type=int, default=0)
    args = parser.parse_args(argv)
    import onnx

    folder = Path(args.model)
    output = Path(args.output or folder / f"search_model{'_int8' if args.precision == 'int8' else ''}.onnx")
    try:
        model = build_search_model(folder, args.precision, args.early_stopping, args.no_repeat_ngram_size)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(str(error)) from error
    onnx.save(model, str(output))
    print(f"Saved the BeamSearch model to {output}")
    return output


if __name__ == "__main__":
    main()
