"""Batched beam-search translation, BLEU/chrF/chrF++/TER scoring (an offline `evaluate` metric over sacreBLEU) and
term accuracy against a glossary (`term_accuracy`).

Shared by `train.py` (validation and the final test) and `translate.py`. Translation is a thin call into the
translation core (`hf_variants.inference.Translator`), the one path of the translate command, the server and the
pipeline's length rule: a sentence translates the same in evaluation as after training.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

METRIC_DIR = Path(__file__).resolve().parent / "metrics" / "sacrebleu_chrf"


# sacreBLEU's BLEU tokenizers offered by `--bleu_tokenize` (translate, training): the ones that need no download
# (flores101/200 fetch a SentencePiece model); the MeCab ones need sacreBLEU's extras, named by `EXTRAS`
BLEU_TOKENIZERS = ("13a", "intl", "zh", "char", "none", "ja-mecab", "ko-mecab")
DEFAULT_BLEU_TOKENIZE = "13a"
EXTRAS = {"ja-mecab": "ja", "ko-mecab": "ko"}  # tokenizer -> the hf-variants (and sacreBLEU) extra it needs


def check_bleu_tokenize(tokenize: str, flag: str = "--bleu_tokenize") -> str:
    """`tokenize` when it is one of `BLEU_TOKENIZERS` and usable here, else a ValueError naming `flag`: an unknown
    name (listing the known ones), or a MeCab tokenizer whose extra is not installed (naming the extra). Cheap:
    run it before any model loads."""
    if tokenize not in BLEU_TOKENIZERS:
        raise ValueError(
            f"{flag} {tokenize!r} is not a sacreBLEU tokenizer offered here; choose one of {list(BLEU_TOKENIZERS)}."
        )
    if tokenize in EXTRAS:
        from sacrebleu.metrics.bleu import BLEU

        try:
            BLEU(tokenize=tokenize)
        except (ImportError, RuntimeError) as error:
            extra = EXTRAS[tokenize]
            raise ValueError(
                f"{flag} {tokenize} needs MeCab and its dictionary: pip install 'hf-variants[{extra}]' "
                f"(sacreBLEU's '{extra}' extra) ({str(error).strip().splitlines()[0]})"
            ) from error
    return tokenize


@lru_cache(maxsize=1)
def load_metric():
    """The local `evaluate` metric (no Hub access): BLEU, chrF, chrF++ and TER from sacreBLEU with their
    signatures."""
    import evaluate

    return evaluate.load(str(METRIC_DIR))


def score(
    hypotheses: Sequence[str],
    references: Sequence[str] | Sequence[Sequence[str]],
    tokenize: str = DEFAULT_BLEU_TOKENIZE,
    metrics: Sequence[str] = ("bleu", "chrf", "chrfpp", "ter"),
) -> dict:
    """Corpus BLEU, chrF, chrF++ and TER (sacreBLEU, each with its signature) of detokenized `hypotheses`.

    `references`: one reference set (a list of strings, one per hypothesis), or several sets (a list of such lists,
    sacreBLEU's layout: `sacrebleu.corpus_bleu(hypotheses, references)`) for multi-reference scores. `tokenize`:
    BLEU's tokenizer (`BLEU_TOKENIZERS`). The keys: bleu, chrf, chrfpp, ter, sacrebleu_signature (BLEU's),
    chrf_signature, chrfpp_signature, ter_signature, bleu_precisions, bleu_brevity_penalty, sys_len, ref_len."""
    hypotheses = list(hypotheses)
    references = list(references)
    sets = [references] if not references or isinstance(references[0], str) else [list(r) for r in references]
    if not hypotheses:
        raise ValueError("Nothing to score.")
    for i, refs in enumerate(sets):
        if any(not isinstance(r, str) for r in refs):
            raise TypeError("references: one list of strings per reference set.")
        if len(refs) != len(hypotheses):
            which = f"reference set {i + 1} has" if len(sets) > 1 else "but"
            raise ValueError(f"{len(hypotheses)} hypotheses {which} {len(refs)} references.")
    check_bleu_tokenize(tokenize, flag="tokenize=")
    per_hypothesis = [list(refs) for refs in zip(*sets)]
    return load_metric().compute(
        predictions=hypotheses, references=per_hypothesis, tokenize=tokenize, metrics=list(metrics)
    )


def term_accuracy(sources: Sequence[str], hypotheses: Sequence[str], glossary) -> dict:
    """Term accuracy, the WMT terminology task's measure: of the glossary terms that apply to the sources (a term
    counts once per sentence it applies to), the share whose target term (one of its forms) the hypothesis of that
    sentence contains, matched with the glossary's own options (`hf_variants.inference.glossary.Glossary`: case,
    whole words). Returns {"term_accuracy": the share (None when no term applies), "terms": terms applied,
    "terms_found": those found, "sentences_with_terms": sentences with at least one term}; for the same
    hypotheses with and without the glossary's constraints, the gain the glossary brings."""
    sources, hypotheses = list(sources), list(hypotheses)
    if len(sources) != len(hypotheses):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(sources)} sources.")
    applied = found = sentences = 0
    for source, hypothesis in zip(sources, hypotheses):
        checks = glossary.check(source, hypothesis)
        applied += len(checks)
        found += sum(check.found for check in checks)
        sentences += bool(checks)
    return {
        "term_accuracy": found / applied if applied else None,
        "terms": applied,
        "terms_found": found,
        "sentences_with_terms": sentences,
    }


MAX_LEN_A, MAX_LEN_B = 1.2, 10  # training's default length rule (fairseq's max_len_a / max_len_b)


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """The indices of `lengths` (source lengths in tokens), longest first, `batch_size` a batch: the translation
    core's sentence batches (`hf_variants.inference.batching.length_sorted_batches`)."""
    from ..inference.batching import length_sorted_batches as batches

    return batches(lengths, batch_size=batch_size)


def new_token_limit(
    source_length: int, max_len_a: float = MAX_LEN_A, max_len_b: int = MAX_LEN_B, positions: int | None = None
) -> int:
    """The length rule for one source of `source_length` tokens: max(1, int(a * length + b)) new tokens, at most the
    model's target positions (`positions`: config.max_position_embeddings, which generate() refuses to exceed)."""
    limit = max(1, int(max_len_a * source_length + max_len_b))
    return min(limit, positions) if positions else limit


@torch.no_grad()
def translate(
    model,
    tokenizer,
    texts: Sequence[str],
    tgt_lang: str | Sequence[str] | None = None,
    src_lang: str | None = None,
    batch_size: int = 64,
    num_beams: int = 4,
    length_penalty: float = 0.6,
    max_len_a: float = MAX_LEN_A,
    max_len_b: int = MAX_LEN_B,
    max_source_length: int | None = None,
    variant_inputs: dict[str, Sequence] | None = None,
    max_tokens: int | None = None,
    **options,
) -> list[str]:
    """Translate `texts` with the translation core (`hf_variants.inference.Translator`) in length-sorted batches of
    `batch_size` sentences (or `max_tokens` tokens); returns the detokenized 1-best hypotheses in input order.

    The output limit is the length rule per sentence: at most `max_len_a` x (the sentence's own source length) +
    `max_len_b` new tokens, so a hypothesis does not depend on its batch. `tgt_lang` is one code or one per text;
    `max_source_length` truncates long sources; `variant_inputs` maps extra `prepare_translation_inputs` arguments
    to one value per text (e.g. MG-SA's `parses`); other keyword arguments are `DecodeOptions` fields
    (`no_repeat_ngram_size=3`, ...). An empty text, or one longer than the model accepts, translates to "" (the
    latter with a warning).
    """
    from ..inference import DecodeOptions, TranslationRequest, Translator

    texts = list(texts)
    variant_inputs = dict(variant_inputs or {})
    for name, values in variant_inputs.items():
        if len(values) != len(texts):
            raise ValueError(f"{len(values)} values of {name!r} for {len(texts)} texts.")
    if not texts:
        return []
    tgt_langs = [tgt_lang] * len(texts) if tgt_lang is None or isinstance(tgt_lang, str) else list(tgt_lang)
    if len(tgt_langs) != len(texts):
        raise ValueError(f"{len(tgt_langs)} target languages for {len(texts)} texts.")
    requests = [
        TranslationRequest(
            text,
            src_lang=src_lang,
            tgt_lang=lang,
            annotations={name: values[i] for name, values in variant_inputs.items()},
        )
        for i, (text, lang) in enumerate(zip(texts, tgt_langs))
    ]
    decode = DecodeOptions(
        num_beams=num_beams,
        length_penalty=length_penalty if num_beams > 1 else None,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
        max_source_length=max_source_length,
        **options,
    )
    was_training = model.training
    model.eval()
    try:
        results = Translator(model, tokenizer).translate(
            requests, decode, batch_size=batch_size, max_tokens=max_tokens
        )
    finally:
        model.train(was_training)
    too_long = [r.index for r in results if r.skipped == "too long"]
    if too_long:
        logger.warning(
            "%d sources longer than the model accepts (e.g. text %d, %d tokens): translated to an empty string",
            len(too_long),
            too_long[0],
            results[too_long[0]].source_tokens,
        )
    return [r.text for r in results]


def translate_distributed(
    accelerator, model, tokenizer, texts: Sequence[str], tgt_langs: Sequence[str], **kwargs
) -> list[str] | None:
    """`translate` with the texts split over the processes; the main process gets all hypotheses in order, the
    others get None."""
    from accelerate.utils import gather_object

    rank, world = accelerator.process_index, accelerator.num_processes
    idx = list(range(rank, len(texts), world))
    # the same number of sentences (so of generate calls) on every process: sharded models (FSDP) generate in
    # lockstep; the padding repeats sentence 0 and is dropped below
    idx += [0] * (math.ceil(len(texts) / world) - len(idx)) if texts else []
    variant_inputs = {
        name: [values[i] for i in idx] for name, values in (kwargs.pop("variant_inputs", None) or {}).items()
    }
    hyps = translate(
        model, tokenizer, [texts[i] for i in idx], [tgt_langs[i] for i in idx], variant_inputs=variant_inputs, **kwargs
    )
    n_real = len(range(rank, len(texts), world))
    mine = list(zip(idx[:n_real], hyps[:n_real]))
    gathered = gather_object(mine) if world > 1 else mine
    if not accelerator.is_main_process:
        return None
    out: list[str | None] = [None] * len(texts)
    for i, h in gathered:
        out[i] = h
    missing = [i for i, h in enumerate(out) if h is None]
    if missing:
        raise RuntimeError(f"{len(missing)} hypotheses were lost while gathering (first index {missing[0]}).")
    return out  # type: ignore[return-value]
