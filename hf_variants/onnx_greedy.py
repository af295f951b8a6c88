"""Greedy search on the shared-cache step graph with every input and output bound once (`OrtModelForSeq2SeqLM`).

transformers' loop (and ONNX Runtime's BeamSearch op, less so) spends a step's time around the graph as well as in
it: feeds gathered and bound, logits copied and processed, the cache handed on. On the shared-cache step graph
(`OrtSharedCache`: the self-attention cache in buffers that DecoderMaskedMultiHeadAttention writes in place) nothing
of a step's inputs moves but the new token and the filled length. So `greedy_search` binds the graph's inputs and
outputs once (IO binding on torch tensors, numpy views of them) and per step only writes the tokens and the length in
place, runs the graph, and takes the argmax of the logits buffer in numpy. It decodes what transformers' greedy search
decodes, with the logits processors the BeamSearch op takes (`onnx_generation.search_op_settings`: tokens never
generated, eos suppressed below a minimum length; not no_repeat_ngram_size): finished rows are fed the fill id
(transformers' pad) as transformers feeds them, and decoding stops at `max_length` or when every row has ended.

Measured (small baseline, batch 32, 20 new tokens, 1 thread, AMD EPYC; `python benchmarks/bench_ort_search_op.py --size
small --threads 1 --reps 5`): 1.19x (fp32) / 1.22x (int8) the BeamSearch op's tok/s. No imports of the model's module:
the graph (`_Graph`), the feeds and the cache come from `OrtModelForSeq2SeqLM.shared_cache_greedy`.
"""

from __future__ import annotations

import numpy as np
import torch


def greedy_search(graph, feeds: dict, kinds: list[str], cache, settings: dict, vocab_size: int):
    """Greedy search from the start token in `feeds["decoder_input_ids"]` ([rows, 1]).

    `graph`: the shared-cache step graph (`_Graph`); `feeds`: its inputs but the cache and its length (encoder
    outputs, cross-attention keys/values, masks, step inputs); `kinds`: the cache's names, in `cache.tensors`' order;
    `cache`: an empty `OrtSharedCache` of beam width 1; `settings`: `onnx_generation.search_op_settings`' mapping;
    `vocab_size`: the logits' last dimension.
    Returns the sequences [rows, length] as transformers returns them: the start token, the tokens, eos where a row
    ended, then the fill id, cut at the step where every row had ended or at max_length."""
    inputs, attributes = settings["inputs"], settings["attributes"]
    eos, fill, max_length = attributes["eos_token_id"], settings["fill"], inputs["max_length"]
    min_length = inputs["min_length"]
    never = np.flatnonzero(np.asarray(inputs["vocab_mask"]) == 0)
    rows = cache.rows
    # written in place between runs: the binding reads these tensors (allocated in the graph's dtypes: not copied)
    tokens = feeds["decoder_input_ids"].to(graph.input_dtype("decoder_input_ids")).clone()
    tokens_now = tokens.numpy()
    length = torch.zeros(1, dtype=graph.input_dtype("past_sequence_length"))
    length_now = length.numpy()
    logits = torch.empty(rows, 1, vocab_size)
    scores = logits.numpy()[:, 0]
    feeds = dict(
        feeds,
        decoder_input_ids=tokens,
        past_sequence_length=length,
        beam_width=torch.ones(1, dtype=torch.int32),
    )
    sequences = np.full((rows, max(max_length, 1)), fill, dtype=np.int64)
    sequences[:, 0] = tokens_now[:, 0]
    running = np.ones(rows, dtype=bool)
    binding, bound_capacity, keep = None, None, None
    width = 1
    while width < max_length:
        cache.reserve()
        if cache.capacity != bound_capacity:  # first step, or the buffers grew: bind them (and the rest) again
            buffers = dict(zip(kinds, cache.tensors))
            bound = dict(feeds, cache_indirection=cache.indirection, **{f"past_{k}": t for k, t in buffers.items()})
            outputs = {"logits": logits, **{f"present_{k}": t for k, t in buffers.items()}}
            binding, keep = graph.bind(bound, outputs)  # `keep`: what the binding reads, alive while it runs
            bound_capacity = cache.capacity
        graph.session.run_with_iobinding(binding)
        if never.size:
            scores[:, never] = -np.inf
        if width < min_length:
            scores[:, eos] = -np.inf
        chosen = np.where(running, scores.argmax(1), fill)
        sequences[:, width] = chosen
        width += 1
        cache.advance()
        running &= chosen != eos
        if not running.any():
            break
        tokens_now[:, 0] = chosen
        length_now[0] = cache.length
    return torch.from_numpy(sequences[:, :width])
