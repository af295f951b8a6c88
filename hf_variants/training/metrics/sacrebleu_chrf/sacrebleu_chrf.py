"""Offline `evaluate` metric: corpus BLEU and chrF from sacreBLEU, with their signatures.

`evaluate.load("sacrebleu")` downloads the metric script from the Hub; this local script needs no network:

    import evaluate
    metric = evaluate.load("training/metrics/sacrebleu_chrf")
    metric.compute(predictions=["a cat"], references=[["a cat"]])
    # {"bleu": ..., "chrf": ..., "sacrebleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:...",
    #  "chrf_signature": "...", ...}

Scores are sacreBLEU's on detokenized text (default 13a tokenization, or `tokenize=...`); `references` holds one
list of references per prediction (same count for every prediction).
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
"""

_DESCRIPTION = "Corpus BLEU and chrF (sacreBLEU) on detokenized text, with the sacreBLEU signatures."

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): system outputs (detokenized).
    references (list of list of str): references per prediction; every prediction has the same number.
    tokenize (str): sacreBLEU tokenizer for BLEU, default "13a" ("intl", "zh", "ja-mecab", "char", "none" ...).
    lowercase (bool): case-insensitive BLEU, default False.
    chrf_word_order (int): 0 for chrF (default), 2 for chrF++.
Returns:
    bleu, chrf (floats, 0-100), sacrebleu_signature, chrf_signature (str), bleu_precisions (list of 4 floats),
    bleu_brevity_penalty, sys_len, ref_len.
"""


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

    def _compute(self, predictions, references, tokenize="13a", lowercase=False, chrf_word_order=0):
        if len(predictions) != len(references):
            raise ValueError(f"{len(predictions)} predictions but {len(references)} reference lists.")
        n_refs = {len(refs) for refs in references}
        if len(n_refs) > 1:
            raise ValueError("Every prediction needs the same number of references.")
        n = n_refs.pop() if n_refs else 1
        ref_streams = [[refs[i] for refs in references] for i in range(n)]
        bleu = sacrebleu.BLEU(tokenize=tokenize, lowercase=lowercase)
        chrf = sacrebleu.CHRF(word_order=chrf_word_order)
        bleu_score = bleu.corpus_score(predictions, ref_streams)
        chrf_score = chrf.corpus_score(predictions, ref_streams)
        return {
            "bleu": bleu_score.score,
            "chrf": chrf_score.score,
            "sacrebleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature()),
            "bleu_precisions": list(bleu_score.precisions),
            "bleu_brevity_penalty": bleu_score.bp,
            "sys_len": bleu_score.sys_len,
            "ref_len": bleu_score.ref_len,
        }
