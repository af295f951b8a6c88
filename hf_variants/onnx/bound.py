"""Greedy and beam search on the shared-cache step graph with every input and output bound once (the default path
of `OrtModelForSeq2SeqLM.generate()`, chosen by `decoding.choose()`).

transformers' loop spends a step's time around the graph as well as in
it: feeds gathered and bound, logits copied and processed, the cache handed on. On the shared-cache step graph
(`OrtSharedCache`: the self-attention cache in buffers that DecoderMaskedMultiHeadAttention writes in place, beams
reordered through the cache indirection) nothing of a step's inputs moves but the new tokens, the filled length and
the indirection. So `BoundStep` binds the graph's inputs and outputs once (IO binding on torch tensors, numpy views
of them) and per step only writes those in place and runs the graph.

- `greedy_search` takes the argmax of the logits buffer in numpy.
- `beam_search` runs a second, small graph on the logits buffer (`beam_head_model`: log-softmax and each row's top
  2 * num_beams + (suppressed tokens) by a two-level TopK; 1.2 ms a step at 128 rows x 8000 tokens where torch's
  log_softmax and topk over the sentences take 2.1 ms, small, 1 thread) and does transformers' beam search
  bookkeeping (`GenerationMixin._beam_search`: the sentences' top 2 * num_beams, finished hypotheses, length
  penalty, every `early_stopping`, `num_return_sequences`) in numpy on those [rows, k] candidates, with
  transformers' float32 arithmetic and order of operations, so its sequences are transformers'. Its first step runs
  once per sentence (the beams are equal there), as CTranslate2 runs it.

Both decode with the logits processors `decoding.search_settings` maps (tokens never generated, eos suppressed
below a minimum length; not no_repeat_ngram_size) and stop where transformers stops. With
`drop=True` (`OrtModelForSeq2SeqLM.drop_finished`, the default) finished sentences leave the batch
(`BoundStep.keep`) once an eighth of it has finished, as CTranslate2 drops them; transformers decodes them to the
batch's end. Their sequences and the others' stay the same, fp32 and int8 (activations quantized per row); in int8
graphs that quantize activations per tensor (exported before, or asked for) tokens may differ where the batch does,
and drop=False, every row getting what transformers feeds it, gives the loop's sequences. No imports of the model's
module: the graphs (`_Graph`), the feeds and the cache come from `OrtModelForSeq2SeqLM`.

Measured against ONNX Runtime's `com.microsoft::BeamSearch` op running the same graphs' whole loop (small baseline,
batch 32, 20 new tokens, 1 thread, AMD EPYC): the op's tok/s times greedy 1.08 (fp32) / 1.39 (int8), beam 4 1.10 /
1.20; the op is no longer used.
"""

from __future__ import annotations

import numpy as np
import torch

# transformers' beam search: the "impossible" score of unfinished and excluded hypotheses (float32, as it adds it)
_EXCLUDED = np.float32(-1.0e9)
_ZERO = np.float32(0.0)
# the share of a batch's sentences that must have finished before `greedy_search` / `beam_search` (drop=True) take
# them out of the batch (`_worth_dropping`)
DROP_SHARE = 0.125


class BoundStep:
    """The shared-cache step graph bound once for one decoding: `run()` runs a step and returns the logits buffer
    ([rows, vocab] numpy view, valid until the next run); `advance(tokens, source_rows)` records the step in the
    cache, reorders it (beam search: row r continues row source_rows[r]) and writes the next tokens and the filled
    length in place; `keep(sentences)` then takes the other sentences out of the batch. The binding is rebuilt only
    when the cache's buffers grow or the batch shrinks."""

    def __init__(self, graph, feeds: dict, kinds: list[str], cache, vocab_size: int):
        """`graph`: the shared-cache step graph (`_Graph`); `feeds`: its inputs but the cache and its length (encoder
        outputs, cross-attention keys/values, masks, step inputs, the start tokens [rows, 1]); `kinds`: the cache's
        names, in `cache.tensors`' order; `cache`: an empty `OrtSharedCache`; `vocab_size`: the logits' last
        dimension."""
        self.graph, self.kinds, self.cache = graph, kinds, cache
        # written in place between runs: the binding reads these tensors (allocated in the graph's dtypes: not copied)
        tokens = feeds["decoder_input_ids"].to(graph.input_dtype("decoder_input_ids")).clone()
        self.tokens = tokens.numpy()
        length = torch.zeros(1, dtype=graph.input_dtype("past_sequence_length"))
        self.length = length.numpy()
        self.logits = torch.empty(cache.rows, 1, vocab_size)
        self.scores = self.logits.numpy()[:, 0]
        width = torch.tensor([cache.beam_width], dtype=graph.input_dtype("beam_width"))
        self.feeds = dict(feeds, decoder_input_ids=tokens, past_sequence_length=length, beam_width=width)
        self._binding, self._capacity, self._keep = None, None, None

    def run(self) -> np.ndarray:
        cache = self.cache
        cache.reserve()
        if cache.capacity != self._capacity:  # first step, or the buffers grew: bind them (and the rest) again
            buffers = dict(zip(self.kinds, cache.tensors))
            bound = dict(
                self.feeds, cache_indirection=cache.indirection, **{f"past_{k}": t for k, t in buffers.items()}
            )
            outputs = {"logits": self.logits, **{f"present_{k}": t for k, t in buffers.items()}}
            self._binding, self._keep = self.graph.bind(bound, outputs)  # `_keep`: what the binding reads
            self._capacity = cache.capacity
        self.graph.session.run_with_iobinding(self._binding)
        return self.scores

    def advance(self, tokens: np.ndarray, source_rows: np.ndarray | None = None) -> None:
        self.cache.advance()
        if source_rows is not None:
            self.cache.reorder_cache(source_rows)
        self.tokens[:, 0] = tokens
        self.length[0] = self.cache.length

    def keep(self, sentences: np.ndarray) -> None:
        """After `advance`: only the rows of `sentences` (indices of the batch's sentences, increasing; each its
        beam width's rows) go on. Their cache positions, tokens and every feed with a row (or sentence) per row (or
        sentence) move to the first rows of their tensors, in place (`compact_rows`: the feeds must be this
        decoding's own), and the next `run` binds those rows."""
        cache = self.cache
        count, width = cache.rows // cache.beam_width, cache.beam_width
        rows = (sentences[:, None] * width + np.arange(width)).reshape(-1)
        feeds = {}
        for name, tensor in self.feeds.items():
            if name in ("past_sequence_length", "beam_width"):
                feeds[name] = tensor
            elif tensor.shape[0] == cache.rows:
                feeds[name] = compact_rows(tensor, rows)
            elif tensor.shape[0] == count:  # the shared-cache graph's source inputs once per sentence
                feeds[name] = compact_rows(tensor, sentences)
            else:
                raise ValueError(f"BoundStep.keep: input {name!r} has {tensor.shape[0]} rows, not {cache.rows}.")
        cache.keep(sentences)
        self.feeds, self.tokens = feeds, feeds["decoder_input_ids"].numpy()
        self.logits = self.logits[: cache.rows]
        self.scores = self.logits.numpy()[:, 0]
        self._binding, self._capacity, self._keep = None, None, None


def compact_rows(tensor: torch.Tensor, kept: np.ndarray, positions: int | None = None) -> torch.Tensor:
    """`tensor`'s rows `kept` (increasing indices) moved to its first len(kept) rows, in place, and the view of those
    rows. Only the rows that move are copied (in numpy, one thread: torch's intra-op pool would spin against ONNX
    Runtime's between two steps), so dropping a batch's last rows, which finish first in length-sorted batches,
    copies nothing; `positions`: of each row only the first `positions` along axis 2 (a cache's filled part)."""
    moved = np.flatnonzero(kept != np.arange(len(kept)))
    if moved.size:
        array = tensor.numpy()
        if positions is None:
            array[moved] = array[kept[moved]]  # the right side is a copy: overlapping rows are safe
        else:
            array[moved, :, :positions] = array[kept[moved], :, :positions]
    return tensor[: len(kept)]


def _worth_dropping(live: np.ndarray) -> bool:
    """Whether the batch drops its finished sentences (`live`: per sentence, whether it goes on): when at least
    `DROP_SHARE` of them (and one) have finished. A drop moves the rows that go on to the front of their buffers
    and binds the graphs again: 0.3-0.5 ms, and about 0.2-0.5 ms more in the next step (measured on the small
    baseline, 1 thread, where a step of 32 rows takes 2.2-3.7 ms); `benchmarks/bench_real_data.py` measures the whole.
    """
    finished = live.size - int(live.sum())
    return finished > 0 and finished >= DROP_SHARE * live.size


def _cancelled(settings: dict) -> bool:
    """Whether the caller's cancel flag (`decoding.search_settings`' "cancelled") says to stop before the next step."""
    flag = settings.get("cancelled")
    return flag is not None and bool(flag())


def _never(settings: dict) -> np.ndarray:
    """The token ids never generated (`decoding.search_settings`' vocabulary mask)."""
    return np.flatnonzero(np.asarray(settings["inputs"]["vocab_mask"]) == 0)


def _sentence_limits(settings: dict) -> np.ndarray | None:
    """Each sentence's new-token limit under the length rule (`SentenceLengthLogitsProcessor`), or None."""
    limits = settings.get("sentence_limits")
    return None if limits is None else np.asarray(limits, dtype=np.int64)


def _force_end(scores: np.ndarray, ending: np.ndarray, eos: int) -> None:
    """The length rule's step in place: the rows `ending` (booleans) may only choose eos."""
    if ending.any():
        kept = scores[ending, eos]
        scores[ending] = -np.inf
        scores[ending, eos] = kept


def greedy_search(step: BoundStep, settings: dict, drop: bool = False) -> torch.Tensor:
    """Greedy search from the start tokens of `step` (beam width 1), with `settings`
    (`decoding.search_settings`' mapping). Returns the sequences [rows, length] as transformers returns
    them: the start token, the tokens, eos where a row ended, then the fill id, cut at the step where every row had
    ended or at max_length. Finished rows are fed the fill id, as transformers feeds them; `drop`: they leave the
    batch instead once `_worth_dropping` says so (the other rows' tokens stay the same, but in int8 graphs whose
    activations are quantized per tensor)."""
    inputs, attributes = settings["inputs"], settings["attributes"]
    eos, fill, max_length = attributes["eos_token_id"], settings["fill"], inputs["max_length"]
    min_length, never, limits = inputs["min_length"], _never(settings), _sentence_limits(settings)
    rows = step.cache.rows
    sequences = np.full((rows, max(max_length, 1)), fill, dtype=np.int64)
    sequences[:, 0] = step.tokens[:, 0]
    running = np.ones(rows, dtype=bool)
    alive = np.arange(rows)  # the rows of `sequences` the batch holds, in its order
    width = 1
    while width < max_length and not _cancelled(settings):
        scores = step.run()
        if never.size:
            scores[:, never] = -np.inf
        if width < min_length:
            scores[:, eos] = -np.inf
        if limits is not None:  # the width-th new token (after the start token): eos where a row's limit is reached
            _force_end(scores, limits[alive] <= width, eos)
        chosen = np.where(running, scores.argmax(1), fill)
        sequences[alive, width] = chosen
        width += 1
        running &= chosen != eos
        if not running.any():
            break
        step.advance(chosen)
        if drop and _worth_dropping(running):
            kept = np.flatnonzero(running)
            step.keep(kept)
            alive, running = alive[kept], running[kept]
    return torch.from_numpy(sequences[:, :width])


def _block_size(vocab_size: int) -> int | None:
    """The block of `beam_head_model`'s two-level top-k: the largest divisor of the vocabulary size from 16 up to
    its square root (None: no such divisor, one TopK over the vocabulary)."""
    divisors = [b for b in range(16, int(vocab_size**0.5) + 1) if vocab_size % b == 0]
    return divisors[-1] if divisors else None


def beam_head_model(vocab_size: int) -> bytes:
    """The serialized ONNX model of beam search's per-step candidates (run on the bound logits buffer):

        logits [rows, 1, vocab] -> log_softmax over the vocabulary, top k ([1]) of each row ->
        values [rows, k] (sorted, best first), indices [rows, k] (token ids).

    A sentence's best 2 * num_beams continuations (log-probability + beam score, suppressed tokens excluded) are
    among its rows' best 2 * num_beams + (number of suppressed tokens): adding a row's beam score keeps the row's
    order. So `beam_search` asks for that many per row and does the rest on [rows, k] in numpy: two passes over the
    logits (ONNX Runtime's LogSoftmax, and the block maxima) instead of four (with the mask's and the beam scores'
    additions), and no [sentences, num_beams * vocab] top-k.

    The top k of a row is two-level where the vocabulary splits into blocks (`_block_size`): the k blocks with the
    highest maxima hold the row's k best tokens (a block holding one of them has a maximum at least the k-th best),
    so TopK runs over the block maxima, then over those k blocks' tokens. Small baseline, 128 rows x 8000 tokens, 1
    thread: 0.62 ms against 0.94 ms for TopK over the row. Tokens of equal log-probability at the k-th place may be
    picked in another order than TopK's over the row (lowest id first)."""
    import onnx
    from onnx import TensorProto, helper

    def constant(name: str, values: list[int]):
        return onnx.numpy_helper.from_array(np.array(values, dtype=np.int64), name)

    block = _block_size(vocab_size)
    nodes = [
        helper.make_node("Reshape", ["logits", "row_shape"], ["row_logits"]),
        helper.make_node("LogSoftmax", ["row_logits"], ["log_probs"], axis=-1),
    ]
    initializers = [constant("row_shape", [0, -1])]
    if block is None:
        nodes.append(helper.make_node("TopK", ["log_probs", "k"], ["values", "indices"], axis=-1, sorted=1))
    else:
        nodes += [
            helper.make_node("Reshape", ["log_probs", "block_shape"], ["blocks"]),  # [rows, blocks, block]
            helper.make_node("ReduceMax", ["blocks"], ["block_max"], axes=[2], keepdims=0),
            helper.make_node("Min", ["k", "block_count"], ["k_blocks"]),  # k above the block count: every block
            helper.make_node("TopK", ["block_max", "k_blocks"], ["_", "top_blocks"], axis=-1, sorted=0),
            helper.make_node("Unsqueeze", ["top_blocks", "last_axis"], ["top_blocks_3d"]),
            helper.make_node("Shape", ["top_blocks"], ["top_shape"]),
            helper.make_node("Concat", ["top_shape", "block_width"], ["gather_shape"], axis=0),
            helper.make_node("Expand", ["top_blocks_3d", "gather_shape"], ["gather_index"]),
            helper.make_node("GatherElements", ["blocks", "gather_index"], ["candidates"], axis=1),
            helper.make_node("Reshape", ["candidates", "row_shape"], ["candidate_rows"]),
            helper.make_node("TopK", ["candidate_rows", "k"], ["values", "positions"], axis=-1, sorted=1),
            helper.make_node("Div", ["positions", "block_width"], ["rank"]),
            helper.make_node("Mod", ["positions", "block_width"], ["offset"]),
            helper.make_node("GatherElements", ["top_blocks", "rank"], ["block_index"], axis=1),
            helper.make_node("Mul", ["block_index", "block_width"], ["block_start"]),
            helper.make_node("Add", ["block_start", "offset"], ["indices"]),
        ]
        initializers += [
            constant("block_shape", [0, vocab_size // block, block]),
            constant("block_count", [vocab_size // block]),
            constant("block_width", [block]),
            constant("last_axis", [2]),
        ]
    inputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", 1, vocab_size]),
        helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
    ]
    outputs = [
        helper.make_tensor_value_info("values", TensorProto.FLOAT, ["rows", "k"]),
        helper.make_tensor_value_info("indices", TensorProto.INT64, ["rows", "k"]),
    ]
    graph = helper.make_graph(nodes, "beam_head", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="hf_variants")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


# `_Graph`'s description of `beam_head_model`'s inputs and outputs (names and ONNX dtypes)
BEAM_HEAD_IO = {
    "inputs": [{"name": "logits", "dtype": "float"}, {"name": "k", "dtype": "int64"}],
    "outputs": [{"name": "values", "dtype": "float"}, {"name": "indices", "dtype": "int64"}],
}


def _first_position_to_beams(first, cache, beams: int) -> None:
    """Each sentence's first cache position, computed once (`first`: one row per sentence), into the rows of its
    `beams` beams (`cache`), as if every beam had computed it."""
    for one, every in zip(first.tensors, cache.tensors):
        sentences, heads, _, head_dim = one.shape
        every.view(sentences, beams, heads, -1, head_dim)[:, :, :, :1] = one[:, None, :, :1]


class _Candidates:
    """The candidates graph (`beam_head_model`) bound on a step's logits buffer: `run(first)` runs it and returns each
    row's best `per_row` log-probabilities and token ids ([rows, per_row] numpy views, valid until the next run).
    With `first` (the step graph at one row per sentence), the first step's candidates come from there: the first
    beam of each sentence holds them, the other beams none (-inf: transformers scores them -1e9 + log-probability,
    never in a sentence's top candidates)."""

    def __init__(self, head, step: BoundStep, first: BoundStep | None, per_row: int, beams: int):
        self.head, self.beams, self.per_row = head, beams, per_row
        self.values, self.indices, self._bindings = {}, {}, {}
        self.bind("step", step)
        if first is not None:
            self.bind("first", first)

    def bind(self, name: str, source: BoundStep) -> None:
        """Bind the graph on `source`'s logits buffer (again after `BoundStep.keep`) as `name`."""
        rows = source.scores.shape[0]
        values, indices = torch.empty(rows, self.per_row), torch.empty(rows, self.per_row, dtype=torch.long)
        feeds = {"logits": source.logits, "k": torch.tensor([self.per_row])}
        # the binding and the tensors it reads, alive as long as it runs
        self._bindings[name] = self.head.bind(feeds, {"values": values, "indices": indices}), values, indices
        self.values[name], self.indices[name] = values.numpy(), indices.numpy()

    def run(self, first: bool) -> tuple[np.ndarray, np.ndarray]:
        name = "first" if first else "step"
        self.head.session.run_with_iobinding(self._bindings[name][0][0])
        values, indices = self.values["step"], self.indices["step"]
        if first:
            sentences, per_row = self.values["first"].shape
            values.reshape(sentences, self.beams, per_row)[:] = -np.inf
            values[:: self.beams] = self.values["first"]
            indices.reshape(sentences, self.beams, per_row)[:] = self.indices["first"][:, None]
        return values, indices


class _Finished:
    """transformers' finished hypotheses of each sentence (`_update_finished_beams`): num_beams slots of sequences
    (as wide as max_length, the fill id after each end), scores (length-penalized; -1e9 while a slot is empty),
    generated lengths and whether the slot holds a finished hypothesis."""

    def __init__(self, start: np.ndarray, max_length: int, fill: int):
        sentences, beams, _ = start.shape
        self.sequences = np.full((sentences, beams, max(max_length, 1)), fill, dtype=np.int64)
        self.sequences[:, :, :1] = start
        self.scores = np.full((sentences, beams), _EXCLUDED, dtype=np.float32)
        self.lengths = np.zeros((sentences, beams), dtype=np.int64)
        self.done = np.zeros((sentences, beams), dtype=bool)

    def join(
        self, alive, candidates, values, joined, generated: int, penalty: float, improvable, early_stopping
    ) -> None:
        """Candidates of the sentences `alive` ([len(alive), k, generated + 1] sequences, their summed
        log-probabilities `values`) that ended and are among the top num_beams (`joined`) replace finished hypotheses
        they outscore, as transformers scores them: by `generated ** penalty`, excluded where the sentence cannot
        improve (or, early_stopping=True, is full)."""
        beams, at = self.scores.shape[1], np.arange(len(alive))[:, None]
        done = self.done[alive]
        scores = values / (generated**penalty)
        if early_stopping is True:
            scores = scores + np.where(done.all(1, keepdims=True), _EXCLUDED, _ZERO)
        scores = scores + np.where(improvable[:, None], _ZERO, _EXCLUDED)
        scores = scores + np.where(joined, _ZERO, _EXCLUDED)
        merged = np.concatenate([self.scores[alive], scores], axis=1)
        kept = np.argsort(-merged, axis=1, kind="stable")[:, :beams]
        # every hypothesis so far ends within the candidates' width: the columns after it hold the fill id
        width = candidates.shape[2]
        sequences = np.concatenate([self.sequences[alive, :, :width], candidates], axis=1)[at, kept]
        self.sequences[alive, :, :width] = sequences
        self.scores[alive] = merged[at, kept]
        lengths = np.full(joined.shape, generated)
        self.lengths[alive] = np.concatenate([self.lengths[alive], lengths], axis=1)[at, kept]
        self.done[alive] = np.concatenate([done, joined], axis=1)[at, kept]

    def may_improve(self, alive, best_running: np.ndarray, best_length: int, penalty: float) -> np.ndarray:
        """transformers' early-stop check per sentence of `alive`: can its best running beam (`best_running`,
        scored as if `best_length` tokens long) beat its worst finished hypothesis (any while a slot is empty)?"""
        scores, done = self.scores[alive], self.done[alive]
        worst = np.where(done, scores.min(1, keepdims=True), _EXCLUDED)
        return (best_running[:, None] / (best_length**penalty) > worst).any(1)

    def output(self, returned: int, prompt: int) -> torch.Tensor:
        """The best `returned` hypotheses of each sentence, as wide as the longest of them."""
        out = self.sequences[:, :returned].reshape(-1, self.sequences.shape[2])
        width = prompt + int(self.lengths[:, :returned].max(initial=0))
        return torch.from_numpy(np.ascontiguousarray(out[:, :width]))


def _end_at_limit(values, indices, ending: np.ndarray, source: BoundStep, at_first: bool, eos: int, beams: int):
    """The candidates of the rows `ending` (their sentence at its length limit) replaced by eos alone, with its
    log-probability from `source`'s logits (at the first step: `first`'s, one row per sentence, eos on the first
    beam of each sentence only)."""
    logits = source.scores.astype(np.float64)
    rows_logits = logits[np.flatnonzero(ending) // beams] if at_first else logits[ending]
    peak = rows_logits.max(1, keepdims=True)
    eos_scores = rows_logits[:, eos] - (peak[:, 0] + np.log(np.exp(rows_logits - peak).sum(1)))
    values, indices = values.copy(), indices.copy()
    if at_first:  # only the first beam of a sentence holds candidates at the first step
        eos_scores = np.where(np.flatnonzero(ending) % beams == 0, eos_scores, -np.inf)
    values[ending] = -np.inf
    values[ending, 0] = eos_scores
    indices[ending] = eos
    return values, indices


def beam_search(
    step: BoundStep,
    head,
    settings: dict,
    early_stopping: bool | str,
    first: BoundStep | None = None,
    drop: bool = False,
) -> torch.Tensor:
    """transformers' beam search (`GenerationMixin._beam_search`) from the start tokens of `step` (rows = sentences *
    num_beams, beams of a sentence adjacent; the cache's beam width num_beams), with `settings`
    (`decoding.search_settings`' mapping: num_beams, length_penalty, num_return_sequences, max_length,
    the processors) and generation_config's `early_stopping` (True, False or "never"). `head`: the `_Graph` of
    `beam_head_model`. `first`: the step graph bound at one row per sentence (beam width 1, the same graph): the
    first step runs there, since every beam of a sentence holds the same start token (transformers runs it on every
    beam; CTranslate2 once per sentence), and its cache position is copied to the
    beams. `drop`: a sentence whose hypotheses can no longer change (transformers' early-stop check says it cannot
    improve) leaves the batch once `_worth_dropping` says so, where transformers runs it on to the end (its tokens
    and the others' stay the same, but in int8 graphs whose activations are quantized per tensor). Returns the
    sequences [sentences * num_return_sequences, length] as transformers returns them (best first; the fill id
    after each hypothesis' end; as wide as the longest returned hypothesis)."""
    inputs, attributes = settings["inputs"], settings["attributes"]
    eos, max_length, min_length = attributes["eos_token_id"], inputs["max_length"], inputs["min_length"]
    penalty, beams, limits = float(inputs["length_penalty"]), inputs["num_beams"], _sentence_limits(settings)
    rows, vocab = step.scores.shape
    sentences, keep = rows // beams, 2 * beams  # transformers keeps (1 + number of eos ids) * num_beams candidates
    prompt = 1  # the start token

    # tokens the processors set to -inf (after the log-softmax): `never` always, eos below the minimum length
    suppressed = np.zeros(vocab, dtype=bool)
    suppressed[_never(settings)] = True
    eos_suppressed = suppressed[eos]
    per_row = min(vocab, keep + int(suppressed.sum()) + (min_length > prompt))
    head_run = _Candidates(head, step, first, per_row, beams)

    # transformers' state: running beams (sequences, scores), finished hypotheses, and per sentence whether its
    # finished hypotheses may still improve
    running_sequences = step.tokens.reshape(sentences, beams, 1).astype(np.int64)
    running_scores = np.zeros((sentences, beams), dtype=np.float32)
    running_scores[:, 1:] = _EXCLUDED  # only the first beam's tokens at the first step: the beams are equal
    finished = _Finished(running_sequences, max_length, settings["fill"])
    improvable = np.ones(sentences, dtype=bool)
    top_beams = np.arange(keep) < beams  # only the top num_beams candidates may finish
    # the sentences the batch holds (`finished`'s indices), in its order; per sentence of the batch its first row
    alive = np.arange(sentences)
    first_rows, at = (alive * beams)[:, None], alive[:, None]

    length = prompt
    while length < max_length and not _cancelled(settings):
        at_first = first is not None and length == prompt
        if at_first:
            first.run()
            _first_position_to_beams(first.cache, step.cache, beams)
        else:
            step.run()
        values, indices = head_run.run(at_first)
        if limits is not None:  # the length rule: a sentence at its limit gets eos as its only candidate
            ending = np.repeat(limits[alive] <= length - prompt + 1, beams)
            if ending.any():
                values, indices = _end_at_limit(
                    values, indices, ending, first if at_first else step, at_first, eos, beams
                )
        suppressed[eos] = eos_suppressed or length < min_length
        # the sentence's top `keep` of log-probability + beam score, as transformers' topk over num_beams * vocab
        accumulated = np.where(suppressed[indices], -np.inf, values) + running_scores.reshape(-1, 1)
        accumulated = accumulated.reshape(len(alive), beams * per_row)
        best = np.argsort(-accumulated, axis=1, kind="stable")[:, :keep]
        beam, token, top_values = best // per_row, indices.reshape(len(alive), -1)[at, best], accumulated[at, best]
        candidates = np.concatenate([running_sequences[at, beam], token[:, :, None]], axis=2)  # [sentences, k, len]
        ended = (token == eos) | (length + 1 >= max_length)
        # the best num_beams candidates that did not end run on; the top num_beams that ended may join the finished
        running_candidates = top_values + np.where(ended, _EXCLUDED, _ZERO)
        chosen = np.argsort(-running_candidates, axis=1, kind="stable")[:, :beams]
        joined = ended & top_beams
        if joined.any():
            finished.join(
                alive, candidates, top_values, joined, length + 1 - prompt, penalty, improvable, early_stopping
            )
        running_sequences, running_scores = candidates[at, chosen], running_candidates[at, chosen]
        length += 1
        best_length = max_length - prompt if early_stopping == "never" and penalty > 0.0 else length - prompt
        improvable &= finished.may_improve(alive, running_scores[:, 0], best_length, penalty)
        # a dropped sentence could not improve, so the batch's `improvable` stands for every sentence's; and
        # `ended.all()` (every candidate of every sentence ended) holds only at max_length, where it holds for the
        # dropped sentences too (a beam has one eos among a sentence's 2 * num_beams candidates)
        if not improvable.any() or (early_stopping is True and finished.done.all()) or ended.all():
            break
        step.advance(running_sequences[:, :, -1].reshape(-1), (first_rows + beam[at, chosen]).reshape(-1))
        if drop and _worth_dropping(improvable):
            kept = np.flatnonzero(improvable)
            step.keep(kept)
            head_run.bind("step", step)
            alive, improvable = alive[kept], improvable[kept]
            running_sequences, running_scores = running_sequences[kept], running_scores[kept]
            first_rows, at = (np.arange(len(alive)) * beams)[:, None], np.arange(len(alive))[:, None]
    return finished.output(inputs["num_return_sequences"], prompt)
