"""Offline `evaluate` metric: corpus BLEU, chrF, chrF++ and TER from sacreBLEU, each with its signature.

`evaluate.load("sacrebleu")` downloads the metric script from the Hub; this local script needs no network:

    import evaluate
    from hf_variants.training.evaluation import METRIC_DIR
    metric = evaluate.load(str(METRIC_DIR))  # hf_variants/training/metrics/sacrebleu_chrf
    metric.compute(predictions=["a cat"], references=[["a cat"]])
    # {"bleu": ..., "chrf": ..., "chrfpp": ..., "ter": ...,
    #  "sacrebleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:...",
    #  "chrf_signature": "...", "chrfpp_signature": "...", "ter_signature": "...", ...}

Scores are sacreBLEU's on detokenized text, the same numbers as its command line (`sacrebleu REF1 REF2 -i HYP -m bleu
chrf ter` and `--chrf-word-order 2`): BLEU with the `tokenize` tokenizer (default 13a), chrF (character 6-grams,
beta 2), chrF++ (chrF with word bigrams: `word_order=2`) and TER (sacreBLEU's defaults; with `asian_support` for
the zh, ja-mecab and ko-mecab BLEU tokenizers, whose languages are written without spaces between words).
`references` holds one list of references per prediction, the same number for every prediction (several for
multi-reference scores).
"""

import datasets
import evaluate
import sacrebleu

_CITATION = """\
@inproceedings{post-2018-call,
    title = "A Call for Clarity in Reporting {BLEU} Scores",
    author = "Post, Matt",
    booktitle = "Proceedings of the Third Conference on Machine Translation: Research Papers",
    year = "2018",
    pages = "186--191",
}
@inproceedings{popovic-2015-chrf,
    title = "chr{F}: character n-gram {F}-score for automatic {MT} evaluation",
    author = "Popovi{\\'c}, Maja",
    booktitle = "Proceedings of the Tenth Workshop on Statistical Machine Translation",
    year = "2015",
    pages = "392--395",
}
@inproceedings{popovic-2017-chrf,
    title = "chr{F}++: words helping character n-grams",
    author = "Popovi{\\'c}, Maja",
    booktitle = "Proceedings of the Second Conference on Machine Translation",
    year = "2017",
    pages = "612--618",
}
@inproceedings{snover-etal-2006-study,
    title = "A Study of Translation Edit Rate with Targeted Human Annotation",
    author = "Snover, Matthew and Dorr, Bonnie and Schwartz, Rich and Micciulla, Linnea and Makhoul, John",
    booktitle = "Proceedings of the 7th Conference of the Association for Machine Translation in the Americas",
    year = "2006",
    pages = "223--231",
}
"""

_DESCRIPTION = "Corpus BLEU, chrF, chrF++ and TER (sacreBLEU) on detokenized text, with the sacreBLEU signatures."

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): system outputs (detokenized).
    references (list of list of str): references per prediction; every prediction has the same number.
    tokenize (str): sacreBLEU tokenizer for BLEU, default "13a" ("intl", "zh", "char", "none", "ja-mecab",
        "ko-mecab" ...).
    lowercase (bool): case-insensitive BLEU, default False.
    metrics (list of str): which of "bleu", "chrf", "chrfpp", "ter" to compute, default all.
Returns:
    bleu, chrf, chrfpp, ter (floats, 0-100; TER: lower is better) and their signatures sacrebleu_signature (BLEU's),
    chrf_signature, chrfpp_signature, ter_signature (str); with BLEU also bleu_precisions (list of 4 floats),
    bleu_brevity_penalty, sys_len, ref_len.
"""

METRICS = ("bleu", "chrf", "chrfpp", "ter")
# BLEU tokenizers of languages written without spaces between words: TER then splits them as sacreBLEU's
# `--ter-asian-support` does
ASIAN_TOKENIZERS = ("zh", "ja-mecab", "ko-mecab")


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SacrebleuChrf(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            homepage="https://github.com/mjpost/sacrebleu",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Value("string", id="sequence"),
                    "references": datasets.Sequence(datasets.Value("string", id="sequence"), id="references"),
                }
            ),
            reference_urls=["https://github.com/mjpost/sacrebleu"],
        )

    def _compute(self, predictions, references, tokenize="13a", lowercase=False, metrics=METRICS):
        unknown = sorted(set(metrics) - set(METRICS))
        if unknown:
            raise ValueError(f"Unknown metrics {unknown}; known: {list(METRICS)}.")
        if len(predictions) != len(references):
            raise ValueError(f"{len(predictions)} predictions but {len(references)} reference lists.")
        n_refs = {len(refs) for refs in references}
        if len(n_refs) > 1:
            raise ValueError("Every prediction needs the same number of references.")
        n = n_refs.pop() if n_refs else 1
        ref_streams = [[refs[i] for refs in references] for i in range(n)]
        scorers = {
            "bleu": lambda: sacrebleu.BLEU(tokenize=tokenize, lowercase=lowercase),
            "chrf": lambda: sacrebleu.CHRF(),
            "chrfpp": lambda: sacrebleu.CHRF(word_order=2),
            "ter": lambda: sacrebleu.TER(asian_support=tokenize in ASIAN_TOKENIZERS),
        }
        result = {}
        for name in METRICS:
            if name not in metrics:
                continue
            scorer = scorers[name]()
            corpus = scorer.corpus_score(predictions, ref_streams)
            result[name] = corpus.score
            result["sacrebleu_signature" if name == "bleu" else f"{name}_signature"] = str(scorer.get_signature())
            if name == "bleu":
                result.update(
                    bleu_precisions=list(corpus.precisions),
                    bleu_brevity_penalty=corpus.bp,
                    sys_len=corpus.sys_len,
                    ref_len=corpus.ref_len,
                )
        return result
