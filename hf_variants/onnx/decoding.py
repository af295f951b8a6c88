"""Which decoding path `OrtModelForSeq2SeqLM.generate()` runs, and why: the one place that decides.

transformers' `generate()` prepares a call (generation config, logits processors, stopping criteria, model inputs)
and hands it to the model's `_sample` (greedy search, sampling) or `_beam_search`; the model asks `choose()` here,
records the answer in `model.last_decoding` ({"path", "reason"}, and "cache" for the loop) and runs that path:

| request                                              | path           | why                                      |
|------------------------------------------------------|----------------|------------------------------------------|
| greedy search; the folder has the shared-cache graph | `bound_greedy` | fastest measured: inputs and outputs     |
| beam search (any early_stopping, length penalty,     | `bound_beam`   | bound once, transformers' bookkeeping in |
|   returned sequences); the same folder               |                | numpy (`bound`), same tokens as torch    |
| a folder without that graph (MUTE, HySAN,            | `loop`         | the bound search runs on that graph only |
|   --no_shared_cache, --no_fuse_attention)            |                |                                          |
| sampling, other logits processors or stopping        | `loop`         | the bound search implements only what    |
|   criteria, no_repeat_ngram_size, scores or          |                | `search_settings` maps; the reason names |
|   return_dict_in_generate, streamers,                |                | the first thing it does not              |
|   use_cache=False, a decoder prompt, inputs_embeds,  |                |                                          |
|   several eos ids, inputs beside source and language |                |                                          |

`loop` is transformers' own decoding method over the step graph: on the shared-cache graph where the folder has it
(`OrtSharedCache`, `last_decoding["cache"] == "shared_buffer"`), else on the step graph's concatenated cache
(`"concatenated"`). Both paths decode token for token like the torch model in fp32.

The bound search is the default because it is the fastest path measured. It replaced ONNX Runtime's
`com.microsoft::BeamSearch` op: it decodes at 1.08x (fp32) / 1.39x (int8) the op's tok/s greedy and 1.10x / 1.20x
beam 4 (small baseline, batch 32, 20 new tokens, 1 thread), and the op decoded some beam searches unlike
transformers (its early-stop check and its score of hypotheses reaching `max_length` differ). The loop stays for
everything the bound search does not implement and for folders without the shared-cache graph.

Nothing here imports or calls the model class: `choose()` takes what it reads as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

BOUND_GREEDY, BOUND_BEAM, LOOP = "bound_greedy", "bound_beam", "loop"
# the model inputs the bound search takes (its graphs read the source and the target language)
_BOUND_MODEL_KWARGS = {"encoder_outputs", "attention_mask", "use_cache", "cache", "past_key_values", "tgt_lang_ids"}
# generate() flags asking for outputs the bound search does not return
_OUTPUT_FLAGS = (
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
    "output_attentions",
    "output_hidden_states",
)


class Unsupported(Exception):
    """The call asks for something the bound search does not implement (the message says what): the loop runs it."""


@dataclass(frozen=True)
class Decision:
    """`path` (BOUND_GREEDY, BOUND_BEAM or LOOP), `reason` (why, in words) and, for the bound paths, `settings`
    (`search_settings`' mapping)."""

    path: str
    reason: str
    settings: dict | None = None

    def record(self) -> dict:
        """What `model.last_decoding` holds."""
        return {"path": self.path, "reason": self.reason}


def may_skip_encoder(bound_available: bool, generation_config, model_input_name: str, model_kwargs: dict) -> bool:
    """Whether generate() may leave the source graph to the bound search (asked before it would run it): the folder
    has the shared-cache graph, and the call asks for greedy or beam search with nothing but the source, its mask and
    the target language as inputs, and no outputs beside the sequences. `choose()` decides per call; where it then
    picks the loop, the model computes the encoder outputs first."""
    from transformers.generation.configuration_utils import GenerationMode

    return (
        bound_available
        and model_input_name == "input_ids"
        and generation_config.get_generation_mode() in (GenerationMode.GREEDY_SEARCH, GenerationMode.BEAM_SEARCH)
        and not any(getattr(generation_config, flag, False) for flag in _OUTPUT_FLAGS)
        and all(v is None or k in ("attention_mask", "use_cache", "tgt_lang_ids") for k, v in model_kwargs.items())
    )


def choose(
    mode: str,
    *,
    bound_available: bool | str,
    input_ids,
    inputs_tensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    model_kwargs: dict,
    vocab_size: int,
) -> Decision:
    """The path of one `generate()` decoding (`mode` "greedy" from `_sample`, "beam" from `_beam_search`; see the
    module docstring's table). `bound_available`: True where the folder has the shared-cache step graph, else the
    reason it has none (a string)."""
    import torch

    if bound_available is not True:
        return Decision(LOOP, f"no shared-cache step graph ({bound_available or 'not in the folder'})")
    if model_kwargs.get("streamer") is not None:
        return Decision(LOOP, "a streamer")
    if model_kwargs.get("synced_gpus"):
        return Decision(LOOP, "synced_gpus")
    if inputs_tensor is None or inputs_tensor.dtype not in (torch.long, torch.int32):
        return Decision(LOOP, "no source input_ids (inputs_embeds)")
    kwargs = {k: v for k, v in model_kwargs.items() if k not in ("streamer", "synced_gpus")}
    try:
        settings = search_settings(
            mode, input_ids, logits_processor, stopping_criteria, generation_config, kwargs, vocab_size
        )
    except Unsupported as unsupported:
        return Decision(LOOP, str(unsupported))
    path = BOUND_GREEDY if mode == "greedy" else BOUND_BEAM
    return Decision(path, f"{mode} search on the shared-cache step graph, inputs and outputs bound once", settings)


def _processor_settings(logits_processor, vocab_size: int, eos: int) -> tuple[set, int, list[int] | None]:
    """What the logits processors of a `generate()` call do, as the bound search's settings: (token ids never
    generated, the length before which eos is suppressed, each sentence's new-token limit of the length rule or
    None). Raises Unsupported for anything else."""
    from transformers.generation.logits_process import (
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        SuppressTokensLogitsProcessor,
    )

    from ..generation_transformer_nmt import SentenceLengthLogitsProcessor, TokenSuppressionLogitsProcessor

    suppressed, min_length, rules, limits = set(), 0, [], None
    for processor in logits_processor:
        if type(processor) is SentenceLengthLogitsProcessor:
            if processor.eos_token_id != eos or processor.prompt_length != 1 or limits is not None:
                raise Unsupported("a length rule with another end token, a decoder prompt or twice")
            limits = list(processor.limits)
        elif type(processor) is TokenSuppressionLogitsProcessor:
            rules += [(ids.tolist(), length) for ids, length in processor.rules]
        elif type(processor) is SuppressTokensLogitsProcessor:
            rules.append((processor.suppress_tokens.reshape(-1).tolist(), None))
        elif type(processor) is MinLengthLogitsProcessor:
            rules.append((processor.eos_token_id.reshape(-1).tolist(), processor.min_length))
        elif type(processor) is MinNewTokensLengthLogitsProcessor:
            length = processor.prompt_length_to_skip + processor.min_new_tokens
            rules.append((processor.eos_token_id.reshape(-1).tolist(), length))
        elif type(processor) is NoRepeatNGramLogitsProcessor:
            raise Unsupported(f"no_repeat_ngram_size={processor.ngram_size}")
        else:
            raise Unsupported(f"the logits processor {type(processor).__name__}")
    for ids, length in rules:
        ids = [i for i in ids if 0 <= i < vocab_size]
        if length is None:
            suppressed.update(ids)
        elif set(ids) <= {eos}:
            min_length = max(min_length, int(length))  # eos suppressed while the sequence is shorter
        else:
            raise Unsupported(f"tokens {ids} suppressed up to a length (the bound search suppresses only eos so)")
    return suppressed, min_length, limits


def search_settings(
    mode: str, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs: dict, vocab_size: int
) -> dict:
    """The bound search's settings for a `generate()` call that transformers prepared: {"inputs": max_length,
    min_length, num_beams, num_return_sequences, length_penalty, vocab_mask (0 = never generated)}, {"attributes":
    eos_token_id, decoder_start_token_id}, "fill" (the id after a finished hypothesis, as transformers pads),
    "sentence_limits" (each sentence's new-token limit under the length rule, eos forced there; or None),
    "cancelled" (a stopping criterion's `cancelled()` flag, asked before every step: true ends the search; or None).
    Raises Unsupported naming the first thing the bound search does not implement."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    config = generation_config
    if config.do_sample:
        raise Unsupported("sampling (do_sample=True)" if mode == "greedy" else "beam sampling (do_sample=True)")
    if model_kwargs.get("use_cache") is False:
        raise Unsupported("use_cache=False (every step recomputed)")
    for flag in _OUTPUT_FLAGS:
        if getattr(config, flag, False):
            raise Unsupported(f"{flag}=True (the bound search returns the sequences only)")
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _BOUND_MODEL_KWARGS)
    if extra:
        raise Unsupported(f"model inputs {extra} (the bound search takes the source and tgt_lang_ids)")
    if input_ids.shape[1] != 1:
        raise Unsupported(f"a decoder prompt of {input_ids.shape[1]} tokens (the bound search starts from one)")
    eos = config._eos_token_tensor
    if eos is None or eos.numel() != 1:
        raise Unsupported(f"eos_token_id={config.eos_token_id} (the bound search takes exactly one end token)")
    eos = int(eos.reshape(-1)[0])
    suppressed, min_length, limits = _processor_settings(logits_processor, vocab_size, eos)
    cancelled = None
    for criterion in stopping_criteria:
        if type(criterion) is EosTokenCriteria and criterion.eos_token_id.reshape(-1).tolist() == [eos]:
            continue
        if callable(getattr(criterion, "cancelled", None)):  # a caller's cancel flag: the search asks it every step
            cancelled = criterion.cancelled
            continue
        if type(criterion) is not MaxLengthCriteria:
            raise Unsupported(f"the stopping criterion {type(criterion).__name__}")
    pad = config._pad_token_tensor
    if mode == "beam":
        num_beams, returned, length_penalty = config.num_beams, config.num_return_sequences or 1, config.length_penalty
        fill = int(pad) if pad is not None and int(pad) else eos  # transformers' beam search: pad, or eos for 0
    else:
        mask = model_kwargs.get("attention_mask")
        if (mask is not None and input_ids.shape[0] != mask.shape[0]) or (config.num_return_sequences or 1) > 1:
            raise Unsupported("several sequences per source with greedy search")
        num_beams, returned, length_penalty = 1, 1, 1.0
        fill = int(pad) if pad is not None else eos
    mask = [1] * vocab_size
    for i in suppressed:
        mask[i] = 0
    return {
        "inputs": {
            "max_length": config.max_length,
            "min_length": min_length,
            "num_beams": num_beams,
            "num_return_sequences": returned,
            "length_penalty": float(length_penalty),
            "vocab_mask": mask,
        },
        "attributes": {"eos_token_id": eos, "decoder_start_token_id": int(input_ids[0, 0])},
        "fill": fill,
        "sentence_limits": limits,
        "cancelled": cancelled,
    }
