"""ONNX Runtime inference for every hf_variants model type: `OrtModelForSeq2SeqLM` (optimum's name).

    model = OrtModelForSeq2SeqLM.from_pretrained(OUT)          # written by `python -m hf_variants.export_onnx`
    inputs = model.prepare_translation_inputs(tokenizer, ["A man is riding a horse."])
    outputs = model.generate(**inputs, num_beams=4)            # transformers' generate(): every decoding mode
    pipeline("translation", model=model, tokenizer=tokenizer)  # after `import hf_variants`

`from_pretrained` loads the fp32 graphs unless asked for `precision="int8"` (a folder exported with `--int8` has
both) and logs which graphs it loaded. int8 graphs quantize activations per row, or with calibrated fixed scales
(`model.int8_activations`: either way a sentence's numbers do not depend on the other sentences of its batch); a
folder exported before that, or with
`--int8_activations per_tensor`, still loads, with a warning that its translations can depend on the batch. The
object is the model type's generation class without its weights: transformers' `GenerationMixin.generate()` prepares
each call, so greedy and beam search (length penalty, early stopping, `num_return_sequences`), sampling,
`max_length` / `max_new_tokens`, logits processors, streamers, and the package's conveniences (`tgt_lang`, the
default length rule, the length checks, `prepare_translation_inputs`) behave as on the torch model. Which decoding
runs is decided in one place, `decoding.choose()` (its docstring has the table); `model.last_decoding` records the
path and why:

- greedy and beam search run bound on the shared-cache step graph (`bound`: every input and output bound once,
  transformers' bookkeeping in numpy), where the folder has that graph (`export_onnx`: every decoder attention
  fused; MUTE and HySAN have none);
- the rest runs in transformers' own loop over the step graph: on the shared-cache graph where the folder has it
  (`OrtSharedCache`: preallocated buffers bound as both input and output of every step, written in place by ONNX
  Runtime's DecoderMaskedMultiHeadAttention; beam search permutes a cache indirection instead of copying the
  cache), else on the step graph's cache (`OrtCache`: past -> present, one position longer, reordered by copy like
  the torch cache).

CPU only (onnxruntime's CPUExecutionProvider). Outputs with attentions or hidden states are not available.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import ModelOutput, Seq2SeqLMOutput

from ..compat_transformer_nmt import CACHE_NAME, accepts_cache_alias, cache_field
from ..model_classes import MODEL_CLASSES
from .bound import BEAM_HEAD_IO, BoundStep, beam_head_model, beam_search, compact_rows, greedy_search
from .decoding import BOUND_GREEDY, LOOP, choose, may_skip_encoder
from .manifest import MANIFEST, int8_activations, read_manifest

logger = logging.getLogger(__name__)

_NUMPY = {"float": np.float32, "int64": np.int64, "int32": np.int32, "bool": np.bool_}
# what `pipeline()` and the Auto classes pass to `from_pretrained` that means nothing for an exported folder
_IGNORED_LOADING_KWARGS = {
    "_from_pipeline",
    "_from_auto",
    "revision",
    "token",
    "trust_remote_code",
    "code_revision",
    "cache_dir",
    "local_files_only",
    "device_map",
    "_commit_hash",
    "subfolder",
}
# arguments that selected decoding paths no longer in the package: a clear error instead of silence
_REMOVED_ARGUMENTS = {
    "use_search_op": "ONNX Runtime's BeamSearch op is no longer used: greedy and beam search run bound on the "
    "shared-cache graph, everything else in transformers' loop (see `hf_variants.onnx.decoding`)",
    "shared_cache": "the step graph is chosen by the folder: the shared-cache graph where the export wrote it",
}
_TORCH = {"float": torch.float32, "int64": torch.long, "int32": torch.int32, "bool": torch.bool}
# the shared cache's first capacity: a generate() call's max_length up to this (a plain forward over a cache: this);
# a full buffer grows by doubling
DEFAULT_SHARED_CACHE_CAPACITY = 64
# ONNX Runtime graph transformers every session leaves out (`from_pretrained(disabled_optimizers=)` changes it):
# SkipLayerNormFusion. Its CPU kernel (onnxruntime 1.32) took 2.9-7.2x the time of the Add + LayerNormalization it
# replaces (one per sublayer: 9 per decoder step of the small model), and whole decodings ran 1.04-1.13x faster
# without it (small, 1 thread)
DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)
# how the load's log line names each int8 activation scheme
ACTIVATION_SCHEMES = {"per_row": "per row", "per_tensor": "per tensor", "calibrated": "with calibrated fixed scales"}
# said once per load of int8 graphs that quantize activations per tensor
_PER_TENSOR_WARNING = (
    "{folder}: its int8 graphs quantize activations per tensor{before}: one scale over every sentence of a batch, so "
    "a sentence's translation can change with the other sentences batched with it. Export the model again "
    "(`python -m hf_variants.export_onnx --int8`: activations per row) for translations that do not depend on the "
    "batch."
)


def _exported_before(manifest: dict) -> str:
    """Why a folder's int8 graphs quantize per tensor: exported before the scheme was recorded, or asked for."""
    if "activations" in (manifest.get("int8") or {}):
        return " (exported with --int8_activations per_tensor)"
    return " (exported before int8 activations were quantized per row)"


def inference_session(model, options, providers, disabled_optimizers=DISABLED_OPTIMIZERS):
    """An `onnxruntime.InferenceSession` on `model` (a path or a serialized model) with ONNX Runtime's graph
    transformers named in `disabled_optimizers` left out."""
    import onnxruntime

    return onnxruntime.InferenceSession(
        model, sess_options=options, providers=providers, disabled_optimizers=list(disabled_optimizers)
    )


@dataclass
class OrtEncoderOutput(ModelOutput):
    """What the source graph returns: the encoder output tensors (`encoder_last_hidden_state`, ...) and the
    cross-attention keys/values of every decoder layer, under the graph's output names. `generate()` repeats every
    tensor for beams and returned sequences, as it does with a torch encoder output."""

    last_hidden_state: torch.Tensor | None = None


class OrtCache:
    """The self-attention cache of the step graph: per layer, keys and values [batch, heads, past, head_dim]."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.tensors[0].shape[2] if self.tensors else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.tensors = [t.index_select(0, beam_idx) for t in self.tensors]

    is_compileable = False

    @property
    def is_linear(self) -> list[bool]:
        """Per layer, whether it is a linear-attention (recurrent) state: never (transformers 5.24's generate
        reads it of every cache)."""
        return [False] * (len(self.tensors) // 2)


class OrtSharedCache:
    """The self-attention cache of the shared-cache step graph (`decoder_model_shared_cache*.onnx`, ONNX Runtime's
    DecoderMaskedMultiHeadAttention with `past_present_share_buffer=1`): per layer, key and value buffers [rows,
    heads, capacity, head_dim] that every step binds as both input and output (ORT writes the new position in
    place: no copy of the past per step), the filled length, and the beam bookkeeping the op reads:
    `beam_width` W (rows = sentences * W; 1 for greedy search and sampling) and `indirection` int32 [rows / W, W,
    capacity], for each row and filled position the beam of the same sentence whose buffer row holds it. Beam
    search's `reorder_cache` permutes the indirection (rows x length int32) instead of the buffers. A full buffer
    grows to twice its capacity (one copy) before the next step."""

    is_compileable = False

    def __init__(self, layer_shapes: list[tuple[int, int]], rows: int, capacity: int, beam_width: int = 1):
        """`layer_shapes`: (heads, head_dim) per layer; `tensors`: key and value buffer of each layer, in order."""
        if beam_width < 1 or rows % beam_width:
            beam_width = 1  # not rows of whole sentences: every row its own group (reorders then regroup)
        self.rows, self.capacity, self.length, self.beam_width = rows, max(1, capacity), 0, beam_width
        # never read beyond `length` (ONNX Runtime neither: tested with NaN there), so not zeroed
        self.tensors = [
            torch.empty(rows, heads, self.capacity, head_dim) for heads, head_dim in layer_shapes for _ in range(2)
        ]
        self.indirection = torch.zeros(rows // beam_width, beam_width, self.capacity, dtype=torch.int32)
        self._set_grouping(beam_width)

    def _set_grouping(self, beam_width: int) -> None:
        """Beams of `beam_width` rows; `_table`: the indirection as a numpy [rows, capacity] view (the per-step
        writes below are numpy's: a tenth of torch's indexing time on these small tables)."""
        self.beam_width = beam_width
        self._own_beam = (np.arange(self.rows) % beam_width).astype(np.int32)
        self._sentence = np.arange(self.rows) // beam_width
        self._table = self.indirection.view(self.rows, self.capacity).numpy()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def is_linear(self) -> list[bool]:
        """Per layer, whether it is a linear-attention (recurrent) state: never (read by transformers 5.24)."""
        return [False] * (len(self.tensors) // 2)

    def reserve(self) -> None:
        """Room for one more position: a full buffer grows to twice its capacity (the filled part copied)."""
        if self.length < self.capacity:
            return
        capacity, filled = 2 * self.capacity, self.length
        grown = []
        for tensor in self.tensors:
            new = tensor.new_empty(tensor.shape[0], tensor.shape[1], capacity, tensor.shape[3])
            new[:, :, :filled] = tensor[:, :, :filled]
            grown.append(new)
        indirection = self.indirection.new_zeros(*self.indirection.shape[:2], capacity)
        indirection[..., :filled] = self.indirection[..., :filled]
        self.tensors, self.indirection, self.capacity = grown, indirection, capacity
        self._set_grouping(self.beam_width)

    def advance(self) -> None:
        """After a step wrote position `length` of every row's own buffer row: record it, one position more."""
        self._table[:, self.length] = self._own_beam
        self.length += 1

    def keep(self, sentences: np.ndarray) -> None:
        """Only the rows of `sentences` (indices of this batch's sentences, increasing; each its `beam_width` rows)
        go on: their filled positions and indirection moved to the buffers' first rows, in place (`compact_rows`),
        the buffers' views of those rows kept (a batch that `reorder_cache` regrouped is one sentence)."""
        sentences, width, filled = np.asarray(sentences), self.beam_width, self.length
        rows = (sentences[:, None] * width + np.arange(width)).reshape(-1)
        self.tensors = [compact_rows(tensor, rows, filled) for tensor in self.tensors]
        self.indirection, self.rows = compact_rows(self.indirection, sentences, filled), len(rows)
        self._set_grouping(width)

    def reorder_cache(self, beam_idx: torch.LongTensor | np.ndarray) -> None:
        """Row r continues the hypothesis of row beam_idx[r]: it takes that row's indirection (the buffers stay).
        A source outside r's sentence (W rows) regroups the whole batch as one sentence first."""
        beam_idx = np.asarray(beam_idx.cpu() if isinstance(beam_idx, torch.Tensor) else beam_idx, dtype=np.int64)
        if not np.array_equal(beam_idx // self.beam_width, self._sentence):
            absolute = self._table + (self._sentence * self.beam_width)[:, None].astype(np.int32)
            self.indirection = torch.from_numpy(absolute).view(1, self.rows, self.capacity)
            self._set_grouping(self.rows)
        self._table[:, : self.length] = self._table[beam_idx, : self.length]


def default_session_options(threads: int, spinning: bool):
    """ONNX Runtime session options of `OrtModelForSeq2SeqLM.from_pretrained` without `session_options`: all graph
    optimizations, `threads` intra-op threads (0: ORT's default), one inter-op thread. `spinning`: whether idle
    intra-op threads busy-wait for the next run. Off for the graphs of transformers' Python loop: between two runs
    torch computes the search on the same cores, and ORT's spinning threads took them (small baseline, beam 4, 2
    threads: 1203 tok/s spinning, 2225 not); on for the bound search's step graph, where between two runs only numpy
    works (a whole decoding inside ONNX Runtime, greedy, 2 threads: 11639 tok/s spinning, 8653 not). One thread has
    no idle thread to spin."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return options


class _Graph:
    """One InferenceSession run through IO binding on torch tensors: inputs are read where they are, outputs are
    written into torch buffers allocated here (shapes given by the caller)."""

    def __init__(self, session, io: dict):
        self.session = session
        self.inputs = {v["name"]: v["dtype"] for v in io["inputs"]}
        self.outputs = [v["name"] for v in io["outputs"]]
        self.output_dtypes = {v["name"]: v["dtype"] for v in io["outputs"]}
        # a callable given {name: numpy array} of the session's outputs beyond `io`'s after every `run` (a graph
        # with extra outputs: calibration reads the int8 graphs' row maxima this way); None: they are not fetched
        self.probe = None

    def run(
        self,
        feeds: dict[str, torch.Tensor],
        output_shapes: dict[str, tuple],
        output_buffers: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """`output_buffers`: outputs written into the given tensors (the shared cache's buffers, also bound as
        inputs) instead of new ones."""
        results = {
            name: output_buffers[name]
            if output_buffers and name in output_buffers
            else torch.empty(output_shapes[name], dtype=_TORCH[self.output_dtypes[name]])
            for name in self.outputs
        }
        binding, _inputs = self.bind(feeds, results)
        extra = [o.name for o in self.session.get_outputs() if o.name not in results] if self.probe else []
        for name in extra:
            binding.bind_output(name, "cpu")  # allocated by ONNX Runtime
        self.session.run_with_iobinding(binding)
        if extra:
            values = binding.get_outputs()[len(self.outputs) :]
            self.probe({name: value.numpy() for name, value in zip(extra, values)})
        return results

    def input_dtype(self, name: str) -> torch.dtype:
        """The torch dtype of input `name` (a tensor of it is bound where it is, not converted)."""
        return _TORCH[self.inputs[name]]

    def bind(self, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]):
        """An IO binding of every input to `feeds` and every output to `outputs` (torch tensors, read and written
        where they are), and the input tensors it reads: a feed of another dtype or layout is bound as a converted
        copy, which the caller keeps alive as long as the binding runs (so a binding reused across runs sees
        in-place changes of the feeds that needed no conversion only)."""
        binding, inputs = self.session.io_binding(), {}
        for name, dtype in self.inputs.items():
            tensor = feeds[name]
            if tensor.dtype != _TORCH[dtype] or not tensor.is_contiguous():
                tensor = tensor.to(_TORCH[dtype]).contiguous()
            inputs[name] = tensor
            binding.bind_input(name, "cpu", 0, _NUMPY[dtype], list(tensor.shape), tensor.data_ptr())
        for name in self.outputs:
            tensor = outputs[name]
            binding.bind_output(
                name, "cpu", 0, _NUMPY[self.output_dtypes[name]], list(tensor.shape), tensor.data_ptr()
            )
        return binding, inputs


class _OrtEncoder:
    """`get_encoder()` of the ORT model: runs the source graph (what `generate()` calls once per batch)."""

    main_input_name = "input_ids"

    def __init__(self, owner: OrtModelForSeq2SeqLM):
        self.owner = owner

    def __call__(
        self,
        input_ids=None,
        attention_mask=None,
        tgt_lang_ids=None,
        phrase_index=None,
        phrase_tags=None,
        inputs_embeds=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ) -> OrtEncoderOutput:
        return self.owner.encode(
            input_ids,
            attention_mask,
            tgt_lang_ids=tgt_lang_ids,
            phrase_index=phrase_index,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            **kwargs,
        )

    forward = __call__


class OrtModelForSeq2SeqLM(PreTrainedModel, GenerationMixin):
    """An exported hf_variants model on ONNX Runtime, used like the torch model (see the module docstring).

    `from_pretrained(folder, precision="fp32", num_threads=None, session_options=None, providers=None)` returns an
    instance of the model type's class (e.g. `OrtTransformerNmtForConditionalGeneration`, a subclass of this one
    and of the torch generation class, without its weights): `precision` "fp32" (the default) or "int8" (a folder
    exported with `--int8`)."""

    _auto_class = None
    _ort_classes: dict[str, type] = {}

    def __init__(
        self,
        config,
        folder: Path,
        manifest: dict,
        precision: str,
        session_options=None,
        providers=None,
        generation_config: GenerationConfig | None = None,
        bound_session_options=None,
        disabled_optimizers=DISABLED_OPTIMIZERS,
    ):
        PreTrainedModel.__init__(self, config)  # not the torch class's __init__: no weights (see `ort_class`)
        if generation_config is not None:
            self.generation_config = generation_config
        self.folder, self.manifest, self.precision = folder, manifest, precision
        files = manifest["graphs"][precision]
        providers = providers or ["CPUExecutionProvider"]
        self.disabled_optimizers = tuple(disabled_optimizers)

        def session(name: str):
            return inference_session(str(folder / name), session_options, providers, self.disabled_optimizers)

        self.source_graph = _Graph(session(files["encoder"]), manifest["encoder"])
        self.step_graph = _Graph(session(files["decoder"]), manifest["decoder"])
        # the shared-cache step graph where the folder has it for this precision (the bound search and the loop
        # step on it), else None (the loop steps on `step_graph`'s concatenated cache)
        shared = manifest["shared_cache"]
        self.shared_cache_graph = None
        if shared["written"] and precision in shared["graphs"]:
            self.shared_cache_graph = _Graph(session(shared["graphs"][precision]), shared["decoder"])
        # the bound search's sessions, built on first use: the shared-cache graph (`_bound_graph`) and beam search's
        # candidates graph (`_beam_head`)
        self._bound_step_graph, self._beam_head_graph = None, None
        # the scoring graph's session (`--scoring_graph`), built on first use (`token_log_probs`)
        self._scoring_graph = None
        # the shared cache's first capacity: None picks it (DEFAULT_SHARED_CACHE_CAPACITY); an int: that
        self.shared_cache_capacity: int | None = None
        # the bound search takes finished sentences out of the batch (`bound.DROP_SHARE`), as CTranslate2 does;
        # False decodes every row to the end, as transformers' loop does (the same tokens, but in int8 graphs that
        # quantize activations per tensor, whose numbers depend on the batch's rows)
        self.drop_finished = True
        # False: every decoding runs in transformers' loop, each step through `_Graph.run` (calibration reads the
        # int8 graphs' activations there, `calibration.py`); the same tokens, slower
        self.bound_search = True
        # how the loaded graphs quantize activations: None (fp32), "per_row", "calibrated" or "per_tensor" (`manifest.
        # int8_activations`: a folder exported before the manifest recorded it quantizes per tensor)
        self.int8_activations = int8_activations(manifest) if precision == "int8" else None
        self.num_layers = manifest["num_layers"]
        self._encoder = _OrtEncoder(self)
        self.model = _LanguageIds(MODEL_CLASSES[config.model_type][2].base_model_class.language_ids_field)
        # the path the last generate() decoding took and why (`decoding.Decision.record()`)
        self.last_decoding = None
        self.session_options, self.providers = session_options, providers
        # the bound search's step-graph session options: their own where from_pretrained made them (spinning on)
        self.bound_session_options = bound_session_options or session_options

    # ---------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        precision: str = "fp32",
        num_threads: int | None = None,
        session_options=None,
        providers=None,
        disabled_optimizers=DISABLED_OPTIMIZERS,
        **kwargs,
    ):
        """Load a folder written by `python -m hf_variants.export_onnx`: its fp32 graphs, or with
        `precision="int8"` its int8 graphs (logged once at load, with the activation scheme; graphs that quantize
        activations per tensor warn that a sentence's translation can depend on its batch). The manifest is read as
        untrusted input (`manifest.read_manifest`: every graph inside the folder, every field's type checked).
        `disabled_optimizers`: ONNX Runtime graph transformers every session leaves out (default
        `DISABLED_OPTIMIZERS`, which says why; `()` runs them all). Loading arguments of torch models that
        `pipeline()` passes (`dtype="auto"`, `revision`, `token`, `trust_remote_code`, ...) are accepted where they
        mean nothing here; any other argument raises a TypeError naming it."""
        dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
        if dtype not in (None, "auto", torch.float32, "float32"):
            raise TypeError(
                f"OrtModelForSeq2SeqLM computes in float32 (precision='int8' for int8 weights), not dtype={dtype}."
            )
        removed = sorted(set(kwargs) & set(_REMOVED_ARGUMENTS))
        if removed:
            raise TypeError(
                f"OrtModelForSeq2SeqLM.from_pretrained: `{removed[0]}=` is gone: {_REMOVED_ARGUMENTS[removed[0]]}."
            )
        unknown = sorted(set(kwargs) - _IGNORED_LOADING_KWARGS)
        if unknown:
            raise TypeError(f"OrtModelForSeq2SeqLM.from_pretrained got unexpected arguments {unknown}.")
        folder = Path(pretrained_model_name_or_path)
        manifest = read_manifest(folder)
        try:
            import onnxruntime  # noqa: F401  (the error below, before any session)
        except ImportError as error:
            raise ImportError("OrtModelForSeq2SeqLM needs onnxruntime: pip install 'hf-variants[onnx]'.") from error
        graphs = manifest["graphs"]
        if precision not in graphs:
            raise ValueError(
                f"precision={precision!r}: {folder} has graphs for {sorted(graphs)} (export with --int8 for int8)."
            )
        if manifest["model_type"] not in MODEL_CLASSES:
            raise ValueError(
                f"{folder / MANIFEST}: unsupported model_type {manifest['model_type']!r} "
                f"(supported: {sorted(MODEL_CLASSES)})."
            )
        config = MODEL_CLASSES[manifest["model_type"]][0].from_pretrained(folder)
        bound_session_options = None
        if session_options is None:
            threads = num_threads if num_threads is not None else int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
            session_options = default_session_options(threads, spinning=False)
            bound_session_options = default_session_options(threads, spinning=True)
        try:
            generation_config = GenerationConfig.from_pretrained(folder)
        except OSError:
            generation_config = None
        model = cls.ort_class(config.model_type)(
            config,
            folder,
            manifest,
            precision,
            session_options,
            providers,
            generation_config,
            bound_session_options,
            disabled_optimizers,
        )
        shared = manifest["shared_cache"]
        logger.info(
            "Loaded the %s ONNX graphs of %s: %s%s%s",
            precision,
            folder,
            ", ".join(sorted(graphs[precision].values())),
            f", {shared['graphs'][precision]}" if model.shared_cache_graph is not None else "",
            f" (activations quantized {ACTIVATION_SCHEMES[model.int8_activations]})" if model.int8_activations else "",
        )
        if model.int8_activations == "per_tensor":
            warnings.warn(_PER_TENSOR_WARNING.format(folder=folder, before=_exported_before(manifest)), stacklevel=2)
        return model

    @classmethod
    def ort_class(cls, model_type: str) -> type:
        """The runtime class of `model_type`: `Ort<TorchClass>(OrtModelForSeq2SeqLM, TorchClass)`, made once per model
        type, so that the torch class's generation code (`generate`'s conveniences, `prepare_translation_inputs` and
        MG-SA's `_encode_sources`, the language inputs, the merged logits processors) runs on ONNX Runtime. Its MRO is
        safe: it is the new class, `OrtModelForSeq2SeqLM`, then exactly the torch class's own MRO (C3 can place
        `OrtModelForSeq2SeqLM`'s bases `PreTrainedModel` and `GenerationMixin` where the torch class has them, since it
        derives from both in that order), so a name `OrtModelForSeq2SeqLM` does not define resolves as on the torch
        model, and every method it defines (`__init__`, `forward`, `get_encoder`, `to`, `save_pretrained`, `generate`,
        `_sample`, `_beam_search`, the cache hooks) wins; `__init__` calls only `PreTrainedModel.__init__`, so no torch
        layer is built and the instance holds no weights. `test_onnx.py` checks the MRO, these owners and that no
        parameter exists."""
        ort_class = cls._ort_classes.get(model_type)
        if ort_class is None:
            torch_class = MODEL_CLASSES[model_type][2]
            ort_class = type(
                f"Ort{torch_class.__name__}",
                (OrtModelForSeq2SeqLM, torch_class),
                {"__module__": __name__, "__doc__": OrtModelForSeq2SeqLM.__doc__},
            )
            cls._ort_classes[model_type] = ort_class
        return ort_class

    # -------------------------------------------------------------------------------------- torch-model API
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def get_encoder(self, modality=None):
        return self._encoder

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is an OrtCache, made by the first step

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def to(self, *args, **kwargs):
        """CPU only: moving to another device raises; `.to("cpu")` / dtype float32 are no-ops."""
        for arg in list(args) + list(kwargs.values()):
            if isinstance(arg, (str, torch.device)) and torch.device(arg).type != "cpu":
                raise ValueError(f"OrtModelForSeq2SeqLM runs on onnxruntime's CPU provider; cannot move to {arg}.")
            if isinstance(arg, torch.dtype) and arg != torch.float32:
                raise ValueError(
                    f"OrtModelForSeq2SeqLM computes in float32 (int8 weights with precision='int8'); "
                    f"cannot convert to {arg}."
                )
        return self

    def eval(self):
        return self

    def save_pretrained(self, *args, **kwargs):
        raise NotImplementedError(
            "An ORT model is saved by the exporter: copy its folder "
            f"({self.folder}) or export again with `python -m hf_variants.export_onnx`."
        )

    # ----------------------------------------------------------------------------------------------- graphs
    def encode(
        self,
        input_ids,
        attention_mask=None,
        tgt_lang_ids=None,
        phrase_index=None,
        inputs_embeds=None,
        output_attentions=None,
        output_hidden_states=None,
        **kwargs,
    ) -> OrtEncoderOutput:
        """Run the source graph: the encoder output tensors and every layer's cross-attention keys/values."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError(
                "OrtModelForSeq2SeqLM takes `input_ids` (the exported graphs embed the tokens "
                "themselves); `inputs_embeds` is not supported."
            )
        if output_attentions or output_hidden_states:
            raise ValueError(
                "OrtModelForSeq2SeqLM does not return attentions or hidden states (the exported "
                "graphs do not compute them): use the torch model."
            )
        unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in ("return_dict",))
        if unknown:
            raise ValueError(f"OrtModelForSeq2SeqLM ({self.config.model_type}) takes no input {unknown}.")
        batch, length = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        for name in self.manifest["source_inputs"]:
            value = {"tgt_lang_ids": tgt_lang_ids, "phrase_index": phrase_index}[name]
            if value is None:
                value = self._default_input(name, batch)
            feeds[name] = value
        if phrase_index is not None and "phrase_index" not in feeds:
            raise ValueError(f"`phrase_index` is only used by the syntactic MG-SA; this is {self.config.model_type}.")
        if (
            tgt_lang_ids is not None
            and "tgt_lang_ids" not in feeds
            and not getattr(self.config, "target_language_token", False)
        ):
            raise ValueError(
                f"{type(self).__name__} does not condition on the target language: `tgt_lang_ids` "
                "would be ignored (a multilingual baseline reads the `<2xx>` tag of its source)."
            )
        shapes = self._shapes(self.source_graph, batch=batch, source=length)
        out = self.source_graph.run(feeds, shapes)
        result = OrtEncoderOutput(last_hidden_state=out["encoder_last_hidden_state"])
        for name, value in out.items():
            if name != "encoder_last_hidden_state":
                result[name] = value
        return result

    def _default_input(self, name: str, batch: int) -> torch.Tensor:
        """The value of a graph input the caller did not give: the target language of a single-direction model
        (`config.default_target_language()`), or 0 for a model that does not need it; else a ValueError."""
        if name == "tgt_lang_ids":
            default = getattr(self.config, "default_target_language", lambda: None)()
            if default is not None:
                return torch.full((batch,), self.config.language_id(default), dtype=torch.long)
            if self.manifest.get("tgt_lang_ids_required"):
                raise ValueError(
                    f"This model depends on the target language: pass `tgt_lang_ids` (one id per sentence, the "
                    f"index in config.languages={self.config.languages}), or `tgt_lang=` to `generate`, the "
                    f"pipeline or `prepare_translation_inputs`."
                )
            return torch.zeros(batch, dtype=torch.long)
        raise ValueError(f"The syntactic MG-SA needs `{name}` (from `prepare_translation_inputs(..., parses=...)`).")

    def _shapes(self, graph: _Graph, **dims) -> dict[str, tuple]:
        """Output shapes of `graph` from the manifest's symbolic shapes and the given dimension values (outputs
        with a dimension not given are left out: bound to buffers by the caller)."""
        shapes = {}
        if graph is self.shared_cache_graph:
            io = self.manifest["shared_cache"]["decoder"]
        else:
            io = self.manifest["encoder" if graph is self.source_graph else "decoder"]
        for value in io["outputs"]:
            if any(isinstance(d, str) and d != "past + 1" and d not in dims for d in value["shape"]):
                continue
            shape = []
            for d in value["shape"]:
                if isinstance(d, int):
                    shape.append(d)
                elif d == "past + 1":
                    shape.append(dims["past"] + 1)
                else:
                    shape.append(dims[d])
            shapes[value["name"]] = tuple(shape)
        return shapes

    def _step(
        self,
        token_ids: torch.Tensor,
        encoder_outputs: OrtEncoderOutput,
        attention_mask: torch.Tensor,
        cache: OrtCache | OrtSharedCache | None,
        tgt_lang_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, OrtCache | OrtSharedCache]:
        """One step of the step graph: token_ids [batch, 1] -> logits [batch, 1, vocab], the grown cache (on the
        shared-cache graph where the folder has it)."""
        batch = token_ids.shape[0]
        feeds, kinds = self._step_feeds(token_ids, encoder_outputs, attention_mask, tgt_lang_ids)
        if self.shared_cache_graph is not None and (cache is None or isinstance(cache, OrtSharedCache)):
            return self._shared_cache_step(feeds, kinds, encoder_outputs, attention_mask, cache, batch)
        if cache is None:
            past = []
            for i in range(self.num_layers):
                k, v = encoder_outputs[f"cross_key.{i}"], encoder_outputs[f"cross_value.{i}"]
                past += [
                    k.new_empty(k.shape[0], k.shape[1], 0, k.shape[3]),
                    v.new_empty(v.shape[0], v.shape[1], 0, v.shape[3]),
                ]
        else:
            past = cache.tensors
        for name, tensor in zip(kinds, past):
            feeds[f"past_{name}"] = tensor
        shapes = self._shapes(self.step_graph, batch=batch, source=attention_mask.shape[1], past=past[0].shape[2])
        for name, tensor in zip(kinds, past):  # per-layer head counts of the cache (MUTE/MIMO units)
            shapes[f"present_{name}"] = (batch, tensor.shape[1], tensor.shape[2] + 1, tensor.shape[3])
        out = self.step_graph.run(feeds, shapes)
        return out["logits"], OrtCache([out[f"present_{name}"] for name in kinds])

    def _step_feeds(self, token_ids, encoder_outputs, attention_mask, tgt_lang_ids) -> tuple[dict, list[str]]:
        """The step graphs' inputs but the self-attention cache, and the cache's names (`key.0`, `value.0`, ...)."""
        kinds = [f"{kind}.{i}" for i in range(self.num_layers) for kind in ("key", "value")]
        feeds = {"decoder_input_ids": token_ids, "encoder_attention_mask": attention_mask}
        for name in self.manifest["encoder_fields"]:
            feeds[f"encoder_{name}"] = encoder_outputs[
                f"encoder_{name}" if name != "last_hidden_state" else "last_hidden_state"
            ]
        for name in self.manifest["step_inputs"]:
            value = tgt_lang_ids if tgt_lang_ids is not None else self._default_input(name, token_ids.shape[0])
            feeds[name] = value
        for name in kinds:
            feeds[f"cross_{name}"] = encoder_outputs[f"cross_{name}"]
        return feeds, kinds

    def _new_shared_cache(self, encoder_outputs, rows: int, max_length: int, beam_width: int) -> OrtSharedCache:
        """Empty shared-cache buffers for `rows` rows, the first capacity `max_length` up to the default."""
        capacity = self.shared_cache_capacity or min(max_length, DEFAULT_SHARED_CACHE_CAPACITY)
        shapes = []
        for i in range(self.num_layers):
            cross = encoder_outputs[f"cross_key.{i}"]
            shapes.append((cross.shape[1], cross.shape[3]))
        return OrtSharedCache(shapes, rows, capacity, beam_width)

    def decoding_cache(
        self, encoder_outputs, rows: int, max_length: int, beam_width: int = 1
    ) -> OrtSharedCache | None:
        """The self-attention cache of a decoding driven by the caller through `forward` (one step at a time, beam
        search's rows reordered with the cache's `reorder_cache`, as transformers' loop does): an empty
        `OrtSharedCache` of `rows` rows (`beam_width` beams a sentence, adjacent) where the folder has the
        shared-cache step graph, else None (the first `forward` starts the step graph's `OrtCache`).
        `encoder_outputs`: the source graph's outputs repeated to `rows` rows; `max_length`: the positions the
        decoding may fill (the buffers start at most `DEFAULT_SHARED_CACHE_CAPACITY` long and grow)."""
        if self.shared_cache_graph is None:
            return None
        return self._new_shared_cache(encoder_outputs, rows, max_length, beam_width)

    def _shared_cache_step(self, feeds, kinds, encoder_outputs, attention_mask, cache, batch):
        """`_step` on the shared-cache graph: the buffers bound as both input and output (written in place). A
        forward without a cache starts one of one beam per row (generate()'s loop passes its own, `_run_loop`)."""
        if cache is None:
            cache = self._new_shared_cache(encoder_outputs, batch, DEFAULT_SHARED_CACHE_CAPACITY, 1)
        cache.reserve()
        buffers = dict(zip(kinds, cache.tensors))
        for name, tensor in buffers.items():
            feeds[f"past_{name}"] = tensor
        feeds["past_sequence_length"] = torch.tensor([cache.length], dtype=torch.int32)
        feeds["beam_width"] = torch.tensor([cache.beam_width], dtype=torch.int32)
        feeds["cache_indirection"] = cache.indirection
        shapes = self._shapes(self.shared_cache_graph, batch=batch, source=attention_mask.shape[1])
        out = self.shared_cache_graph.run(feeds, shapes, {f"present_{name}": t for name, t in buffers.items()})
        cache.advance()
        return out["logits"], cache

    # --------------------------------------------------------------------------------------------- scoring
    @property
    def has_scoring_graph(self) -> bool:
        """Whether the folder has the scoring graph (`export_onnx --scoring_graph`) for this precision."""
        scoring = self.manifest.get("scoring") or {}
        return bool(scoring.get("written")) and self.precision in (scoring.get("graphs") or {})

    def token_log_probs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        labels: torch.Tensor,
        tgt_lang_ids: torch.Tensor | None = None,
        phrase_index: torch.Tensor | None = None,
        **unused,
    ) -> torch.Tensor:
        """Forced decoding of whole targets in one run of the scoring graph: each label's log-softmax of the raw
        logits [batch, target], given the source and `decoder_input_ids` (the start token, then the target but its
        last token). Padded label positions (-100 or any other negative id) give 0. Needs `has_scoring_graph`."""
        if not self.has_scoring_graph:
            raise ValueError(
                f"{self.folder} has no scoring graph for precision={self.precision!r}: export with "
                "`--scoring_graph` (the step graph scores one position at a time: `forward`)."
            )
        if self._scoring_graph is None:
            scoring = self.manifest["scoring"]
            path = str(self.folder / scoring["graphs"][self.precision])
            session = inference_session(path, self.session_options, self.providers, self.disabled_optimizers)
            self._scoring_graph = _Graph(session, scoring["io"])
        batch = input_ids.shape[0]
        padded = labels < 0
        feeds = {
            "input_ids": input_ids,
            "attention_mask": attention_mask if attention_mask is not None else torch.ones_like(input_ids),
            "decoder_input_ids": decoder_input_ids,
            "labels": labels.masked_fill(padded, 0),
        }
        for name in self.manifest["source_inputs"]:
            value = {"tgt_lang_ids": tgt_lang_ids, "phrase_index": phrase_index}[name]
            feeds[name] = value if value is not None else self._default_input(name, batch)
        out = self._scoring_graph.run(feeds, {"token_log_probs": tuple(labels.shape)})["token_log_probs"]
        return out.masked_fill(padded, 0.0)

    # -------------------------------------------------------------------------------------------- decoding
    def generate(self, inputs=None, generation_config=None, **kwargs):
        """The torch model's `generate()` (`tgt_lang=`, the length rule, the checks); each decoding then runs on
        the path `decoding.choose()` picks, recorded in `last_decoding`."""
        removed = sorted(set(kwargs) & set(_REMOVED_ARGUMENTS))
        if removed:
            raise TypeError(f"generate(): `{removed[0]}=` is gone: {_REMOVED_ARGUMENTS[removed[0]]}.")
        return super().generate(inputs, generation_config, **kwargs)

    def _bound_available(self) -> bool | str:
        """True where the bound search can run (the shared-cache graph loaded, `bound_search` on), else why not."""
        if not self.bound_search:
            return "turned off (bound_search=False)"
        if self.shared_cache_graph is not None:
            return True
        shared = self.manifest["shared_cache"]
        return shared.get("reason") or f"none for precision={self.precision!r}"

    def _maybe_prepare_encoder_kwargs_for_generation(self, inputs_tensor, model_kwargs, model_input_name, config):
        """generate()'s source-graph run, left to the bound search (which runs it itself) where the call may take
        it: an empty placeholder, filled by `_with_encoder_outputs` if the loop runs after all."""
        if model_kwargs.get("encoder_outputs") is None and may_skip_encoder(
            self._bound_available() is True, config, model_input_name, model_kwargs
        ):
            model_kwargs["encoder_outputs"] = OrtEncoderOutput()
            return model_kwargs
        return super()._maybe_prepare_encoder_kwargs_for_generation(
            inputs_tensor, model_kwargs, model_input_name, config
        )

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, inputs_tensor=None, **kw):
        """Greedy search bound on the shared-cache graph where `decoding.choose()` says so; else (and sampling)
        transformers' `_sample`."""
        return self._decode(
            "greedy",
            super()._sample,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            inputs_tensor,
            kw,
        )

    def _beam_search(
        self, input_ids, logits_processor, stopping_criteria, generation_config, inputs_tensor=None, **kw
    ):
        """Beam search bound on the shared-cache graph where `decoding.choose()` says so; else transformers'
        `_beam_search`."""
        return self._decode(
            "beam",
            super()._beam_search,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            inputs_tensor,
            kw,
        )

    def _decode(
        self, mode, loop, input_ids, logits_processor, stopping_criteria, generation_config, inputs_tensor, kw
    ):
        """One generate() decoding on the path `decoding.choose()` picks: the bound search, or `loop` (transformers'
        decoding method)."""
        decision = choose(
            mode,
            bound_available=self._bound_available(),
            input_ids=input_ids,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            generation_config=generation_config,
            model_kwargs=kw,
            vocab_size=self.config.vocab_size,
        )
        self.last_decoding = decision.record()
        logger.debug("generate(): %s (%s)", decision.path, decision.reason)
        expand = input_ids.shape[0] // inputs_tensor.shape[0] if inputs_tensor is not None else 1
        if decision.path == LOOP:
            kw = self._with_encoder_outputs(inputs_tensor, expand, kw)
            if self.shared_cache_graph is not None and kw.get("use_cache") is not False:
                beams = generation_config.num_beams if mode == "beam" else 1
                kw[CACHE_NAME] = self._new_shared_cache(
                    kw["encoder_outputs"], input_ids.shape[0], generation_config.max_length or 1, beams
                )
            self.last_decoding["cache"] = "shared_buffer" if self.shared_cache_graph is not None else "concatenated"
            return loop(
                input_ids,
                logits_processor=logits_processor,
                stopping_criteria=stopping_criteria,
                generation_config=generation_config,
                **kw,
            )
        mask = kw.get("attention_mask")
        mask = mask[::expand] if mask is not None else torch.ones_like(inputs_tensor)
        return self._bound_search(
            decision, inputs_tensor, mask, kw.get("tgt_lang_ids"), generation_config.early_stopping
        )

    def _with_encoder_outputs(self, inputs_tensor, expand: int, model_kwargs: dict) -> dict:
        """`model_kwargs` with the encoder outputs generate() left to the bound search (an empty placeholder)
        computed, repeated `expand` times per sentence as generate() repeats them."""
        encoder_outputs = model_kwargs.get("encoder_outputs")
        if encoder_outputs is None or encoder_outputs.last_hidden_state is not None:
            return model_kwargs
        mask, tgt_lang_ids = model_kwargs.get("attention_mask"), model_kwargs.get("tgt_lang_ids")
        encoded = self.encode(
            inputs_tensor,
            mask[::expand] if mask is not None else None,
            tgt_lang_ids=tgt_lang_ids[::expand] if tgt_lang_ids is not None else None,
        )
        for key, value in encoded.items():
            encoded[key] = value.repeat_interleave(expand, dim=0) if expand > 1 else value
        return dict(model_kwargs, encoder_outputs=encoded)

    def _bound_search(self, decision, source_ids, attention_mask, tgt_lang_ids, early_stopping) -> torch.Tensor:
        """Greedy or beam search (`decision.path`) of `source_ids` [sentences, length] on the shared-cache step
        graph, its inputs and outputs bound once (`bound`), with `decision.settings` and generation_config's
        `early_stopping`: the sequences, as transformers' greedy or beam search returns them. `tgt_lang_ids`: one per
        decoding row (sentences * num_beams, as generate() expands them) or None. Finished sentences leave the
        batch where `drop_finished`."""
        settings = decision.settings
        greedy = decision.path == BOUND_GREEDY
        beams = 1 if greedy else settings["inputs"]["num_beams"]
        start = settings["attributes"]["decoder_start_token_id"]
        max_length = settings["inputs"]["max_length"]
        first, step = self.bound_steps(source_ids, attention_mask, start, beams, max_length, tgt_lang_ids)
        if greedy:
            return greedy_search(first, settings, drop=self.drop_finished)
        return beam_search(step, self._beam_head(), settings, early_stopping, first=first, drop=self.drop_finished)

    def bound_steps(self, source_ids, attention_mask, start_id: int, beams: int, max_length: int, tgt_lang_ids=None):
        """The bound search's steps (`bound.BoundStep`) of `source_ids` [sentences, length], its source graph run,
        every row at the start token `start_id`: (at one row per sentence, at sentences * `beams` rows or None where
        `beams` is 1), with a cache for up to `max_length` positions (beam search's first step only at the first).
        The shared-cache graph takes the source padding and the cross-attention keys/values once per sentence (the
        beams of a sentence in adjacent rows, as generate() expands its inputs). Every feed is this decoding's own
        (`BoundStep.keep` compacts them in place): the source graph's outputs, and copies of the caller's padding
        and language ids."""
        sentences = source_ids.shape[0]
        attention_mask = attention_mask.clone()
        tgt_lang_ids = tgt_lang_ids.clone() if tgt_lang_ids is not None else None
        sentence_lang = tgt_lang_ids[::beams] if tgt_lang_ids is not None else None
        source_lang = sentence_lang if "tgt_lang_ids" in self.manifest["source_inputs"] else None
        encoded = self.encode(source_ids, attention_mask, tgt_lang_ids=source_lang)
        start = torch.full((sentences, 1), start_id, dtype=torch.long)
        graph, vocab = self._bound_graph(), self.config.vocab_size
        feeds, kinds = self._step_feeds(start, encoded, attention_mask, sentence_lang)
        first_length = max_length if beams == 1 else 2  # beam search: only the first step at these rows
        first = BoundStep(graph, feeds, kinds, self._new_shared_cache(encoded, sentences, first_length, 1), vocab)
        if beams == 1:
            return first, None
        encoded = {
            name: tensor if name.startswith("cross_") else tensor.repeat_interleave(beams, 0)
            for name, tensor in encoded.items()
        }
        feeds, kinds = self._step_feeds(start.repeat_interleave(beams, 0), encoded, attention_mask, tgt_lang_ids)
        cache = self._new_shared_cache(encoded, sentences * beams, max_length, beam_width=beams)
        return first, BoundStep(graph, feeds, kinds, cache, vocab)

    def _bound_graph(self) -> _Graph:
        """The shared-cache graph for the bound search: in a session of its own whose idle threads spin (between two
        runs only numpy works, so a spinning thread takes no core from torch, as it would in transformers' loop),
        built on first use; the loop's session where from_pretrained did not make the options (`session_options`
        given) or with one intra-op thread (no idle thread to spin)."""
        options = self.bound_session_options
        if options is self.session_options or options is None or options.intra_op_num_threads == 1:
            return self.shared_cache_graph
        if self._bound_step_graph is None:
            shared = self.manifest["shared_cache"]
            path = str(self.folder / shared["graphs"][self.precision])
            session = inference_session(path, options, self.providers, self.disabled_optimizers)
            self._bound_step_graph = _Graph(session, shared["decoder"])
        return self._bound_step_graph

    def _beam_head(self) -> _Graph:
        """Beam search's per-step candidates graph (`bound.beam_head_model`), built on first use, on one intra-op
        thread: a session of its own threads would spin against the step graph's between the two runs of every step
        (small baseline, beam 4, 2 threads: 0.81x CTranslate2 int8's tok/s with the step graph's options, 1.79-1.82x
        with one thread)."""
        if self._beam_head_graph is None:
            options = default_session_options(1, spinning=False)
            session = inference_session(
                beam_head_model(self.config.vocab_size), options, self.providers, self.disabled_optimizers
            )
            self._beam_head_graph = _Graph(session, BEAM_HEAD_IO)
        return self._beam_head_graph

    # --------------------------------------------------------------------------------------------- forward
    @accepts_cache_alias
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        decoder_input_ids=None,
        encoder_outputs=None,
        cache=None,
        use_cache=None,
        tgt_lang_ids=None,
        phrase_index=None,
        phrase_tags=None,
        decoder_attention_mask=None,
        inputs_embeds=None,
        decoder_inputs_embeds=None,
        labels=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        """Logits of `decoder_input_ids` after the source: with a cache (`cache`, an `OrtCache`) the
        tokens after its length, one step per token; without one, every token from the start (a full
        recompute: `use_cache=False`). `phrase_tags` only feed MG-SA's training loss and are not read."""
        if labels is not None or decoder_inputs_embeds is not None or decoder_attention_mask is not None:
            raise ValueError(
                "OrtModelForSeq2SeqLM decodes (generate); it takes no `labels`, "
                "`decoder_inputs_embeds` or `decoder_attention_mask`: use the torch model."
            )
        kwargs = {k: v for k, v in kwargs.items() if k not in ("cache_position",) and v is not None}
        if encoder_outputs is None:
            encoder_outputs = self.encode(
                input_ids,
                attention_mask,
                tgt_lang_ids=tgt_lang_ids,
                phrase_index=phrase_index,
                inputs_embeds=inputs_embeds,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                **kwargs,
            )
        elif not isinstance(encoder_outputs, OrtEncoderOutput):
            raise TypeError("`encoder_outputs` must be the OrtEncoderOutput of this model's `get_encoder()`.")
        if attention_mask is None:
            attention_mask = torch.ones(encoder_outputs.last_hidden_state.shape[:2], dtype=torch.long)
        if decoder_input_ids is None:
            decoder_input_ids = torch.full((attention_mask.shape[0], 1), self.config.decoder_start_token_id)
        given, cache = cache, cache if isinstance(cache, (OrtCache, OrtSharedCache)) else None
        if given is not None and cache is None and given.get_seq_length() > 0:
            raise TypeError(
                "OrtModelForSeq2SeqLM keeps its own cache (OrtCache, OrtSharedCache); a torch cache cannot be read."
            )
        start = cache.get_seq_length() if cache is not None else 0
        if use_cache is False:
            cache, start = None, 0
        steps = []
        for position in range(start, decoder_input_ids.shape[1]):
            logits, cache = self._step(
                decoder_input_ids[:, position : position + 1], encoder_outputs, attention_mask, cache, tgt_lang_ids
            )
            steps.append(logits)
        if not steps:
            raise ValueError(
                f"No new decoder token: the cache holds {start} and `decoder_input_ids` has "
                f"{decoder_input_ids.shape[1]}."
            )
        logits = steps[0] if len(steps) == 1 else torch.cat(steps, dim=1)
        return Seq2SeqLMOutput(
            logits=logits,
            **cache_field(cache if use_cache is not False else None),
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
        )

    @accepts_cache_alias
    def prepare_inputs_for_generation(
        self,
        decoder_input_ids,
        cache=None,
        attention_mask=None,
        encoder_outputs=None,
        use_cache=None,
        tgt_lang_ids=None,
        **kwargs,
    ):
        """The step's inputs: the whole `decoder_input_ids` (forward feeds the tokens after the cache)."""
        return {
            "decoder_input_ids": decoder_input_ids,
            "cache": cache,
            "attention_mask": attention_mask,
            "encoder_outputs": encoder_outputs,
            "use_cache": use_cache,
            "tgt_lang_ids": tgt_lang_ids,
        }

    @staticmethod
    def _reorder_cache(cache: OrtCache | OrtSharedCache, beam_idx: torch.LongTensor):
        """Beam search's reordering of the self-attention cache (the cross-attention keys/values are equal within
        a sentence's beams, as in the torch model): a copy of the concatenated cache's rows, or the shared cache's
        indirection permuted."""
        cache.reorder_cache(beam_idx)
        return cache

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(folder={str(self.folder)!r}, precision={self.precision!r}, "
            f"model_type={self.config.model_type!r})"
        )


class _LanguageIds(torch.nn.Module):
    """What the torch class's `generate` / `_language_inputs` read from `self.model`: `language_ids_field`."""

    def __init__(self, language_ids_field):
        super().__init__()
        self.language_ids_field = language_ids_field


__all__ = ["OrtModelForSeq2SeqLM", "OrtEncoderOutput", "OrtCache", "OrtSharedCache"]
