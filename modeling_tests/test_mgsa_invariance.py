"""MG-SA computes the same thing in training, validation and decoding (a lower validation loss with a
lower BLEU could come from a train/inference mismatch; these checks rule the model side out).

For the 45-minute runs' MG-SA (n-gram phrases 2/3/4, SAN composition, ON-LSTM, bottom layer) and two settings
with every other mechanism on (syntactic phrases + tag loss + relative positions + pre-norm + two MG-SA layers;
LSTM composition with projected phrase keys/values), on real sentences through the real input paths:
- the phrase partition, the phrase memory and the encoder output of a sentence are the same encoded alone, in a
  right-padded batch (what `training/evaluation.translate` gives `generate`) and in the training / validation loss
  batch (`training.trainer.make_batch`, with labels); in a left-padded batch the partition is the same (the
  backbone's absolute positions count from the first index, as in transformers' Marian and BART, so left padding
  changes every model's encoder input; every path of the package pads on the right);
- the decoder's logits of greedy incremental (cached) decoding equal the teacher-forced forward logits on the
  decoded tokens (the path the loss is computed on), row by row in a padded batch;
- without dropout, train mode computes what eval mode does (no module but dropout depends on the mode: the ON-LSTM
  has no DropConnect), and with dropout eval mode equals the dropout-free model;
- the label-smoothed loss the tables report is (1 - eps) * NLL + eps * mean_v(-log p_v), as
  `benchmarks/mgsa_analysis.py` splits it.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_sentences
from torch.nn import functional as F

from hf_variants import MgsaConfig, MgsaForConditionalGeneration
from hf_variants.training import external
from hf_variants.training.corpus import Pair
from hf_variants.training.trainer import make_batch

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = [read_sentences("en", "val", n=12)[i] for i in (5, 6, 3, 11, 0)]  # 22, 9, 14, 8, 10 words
TARGETS = [read_sentences("de", "val", n=12)[i] for i in (5, 6, 3, 11, 0)]

SETTINGS = {
    # the 45-minute run (`--model_type mgsa_nmt`, the small preset's MG-SA options) at tiny dims
    "ngram_san_onlstm": dict(
        phrase_type="ngram", ngram_sizes=[2, 3, 4], phrase_composition="san", phrase_interaction="on_lstm"
    ),
    "syntactic_tags_relative_prenorm_two_layers": dict(
        phrase_type="syntactic",
        syntactic_levels=3,
        tag_loss_weight=0.5,
        on_lstm_chunk_size=2,
        mgsa_layers=[0, 1],
        max_relative_positions=4,
        normalize_before=True,
    ),
    "ngram_lstm_composition_projected_kv": dict(
        phrase_type="ngram",
        ngram_sizes=[2, 3],
        phrase_composition="lstm",
        phrase_interaction="lstm",
        mgsa_phrase_kv="project",
    ),
}


def pair_parse(sentence: str) -> str:
    """A deterministic parse of a whitespace-tokenized sentence: words paired under NP, pairs under VP, all under
    S (three phrase levels below the root)."""
    words = [f"(NN {w})" for w in sentence.split()]
    pairs = [f"(NP {' '.join(words[i : i + 2])})" for i in range(0, len(words), 2)]
    groups = [f"(VP {' '.join(pairs[i : i + 2])})" for i in range(0, len(pairs), 2)]
    return f"(ROOT (S {' '.join(groups)}))"


def build(tokenizer, setting: str, **overrides) -> MgsaForConditionalGeneration:
    torch.manual_seed(0)
    config = MgsaConfig.from_preset("tiny", vocab_size=len(tokenizer), **SETTINGS[setting], **overrides)
    return MgsaForConditionalGeneration(config).eval()


def source_kwargs(model, texts) -> dict:
    if model.config.phrase_type == "syntactic":
        return {"parses": [pair_parse(t) for t in texts]}
    return {}


def encode(model, tokenizer, texts, side: str = "right", targets=None) -> dict:
    old = tokenizer.padding_side
    tokenizer.padding_side = side
    try:
        return model.prepare_translation_inputs(tokenizer, texts, text_target=targets, **source_kwargs(model, texts))
    finally:
        tokenizer.padding_side = old


def encoder_view(model, inputs: dict) -> dict:
    """The phrase partition, the phrase memory of the first MG-SA layer and the encoder output of a batch."""
    encoder = model.model.encoder
    captured = {}
    memory = encoder.layers[model.config.mgsa_layers[0]].self_attn.phrase_memory

    def keep(module, args, out):  # returns None: the output is left as it is
        captured["memory"] = out[0]

    hook = memory.register_forward_hook(keep)
    try:
        hidden = encoder(**{k: v for k, v in inputs.items() if k != "labels"})
    finally:
        hook.remove()
    mask = inputs["attention_mask"]
    partition = encoder.phrase_partition(
        mask, mask.shape[1], mask.shape[0], mask.device, inputs.get("phrase_index"), inputs.get("phrase_tags")
    )
    return {"partition": partition, "memory": captured["memory"], "hidden": hidden.last_hidden_state}


def row_view(view: dict, inputs: dict, row: int) -> dict:
    """Row `row` of a batch view on its real tokens and real phrase slots only."""
    real = inputs["attention_mask"][row].bool()
    partition = view["partition"]
    slots = int(partition.mask[row].sum(-1).max())
    return {
        "ids": partition.ids[row][:, real],
        "slot_mask": partition.mask[row, :, :slots],
        "memory": view["memory"][row, :, :slots],
        "hidden": view["hidden"][row, real],
    }


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sentence_alone_padded_and_in_training_batches_encodes_the_same(tokenizer, setting):
    model = build(tokenizer, setting)
    syntactic = model.config.phrase_type == "syntactic"
    pairs = [
        Pair("en", "de", s, t, f"val:{i}", src_extra={"parses": pair_parse(s)} if syntactic else {})
        for i, (s, t) in enumerate(zip(SENTENCES, TARGETS))
    ]
    with torch.no_grad():
        batches = {
            "right-padded (generate)": encode(model, tokenizer, SENTENCES),
            "left-padded": encode(model, tokenizer, SENTENCES, side="left"),
            "training batch (make_batch)": make_batch(model, tokenizer, pairs, bidirectional=False, max_length=128),
        }
        views = {name: encoder_view(model, inputs) for name, inputs in batches.items()}
        for row, text in enumerate(SENTENCES):
            alone_inputs = encode(model, tokenizer, [text])
            alone = row_view(encoder_view(model, alone_inputs), alone_inputs, 0)
            assert int(alone["slot_mask"].sum()) > 0  # the sentence has phrases in every group
            for name, inputs in batches.items():
                got = row_view(views[name], inputs, row)
                assert torch.equal(got["ids"], alone["ids"]), (name, row)
                assert torch.equal(got["slot_mask"], alone["slot_mask"]), (name, row)
                if name == "left-padded":  # absolute positions count from the first (pad) index: the partition only
                    continue
                real_slots = alone["slot_mask"][..., None]
                assert torch.allclose(got["memory"] * real_slots, alone["memory"] * real_slots, atol=1e-5), (name, row)
                assert torch.allclose(got["hidden"], alone["hidden"], atol=1e-5), (name, row)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_incremental_decoding_logits_equal_the_teacher_forced_loss_path(tokenizer, setting):
    model = build(tokenizer, setting)
    inputs = encode(model, tokenizer, SENTENCES)
    steps = 8
    with torch.no_grad():
        out = model.generate(
            **inputs,
            num_beams=1,
            max_new_tokens=steps,
            min_new_tokens=steps,
            output_logits=True,
            return_dict_in_generate=True,
        )
        decoded = torch.stack(out.logits, dim=1)  # [B, steps, V], before any logits processor
        sequences = out.sequences  # the decoder start token, then the steps
        assert sequences.shape[1] == steps + 1
        forced = model(**inputs, decoder_input_ids=sequences[:, :-1]).logits
    assert torch.allclose(decoded, forced, atol=1e-4), (decoded - forced).abs().max()
    # and row by row: each sentence decoded alone gives its row's tokens
    for row, text in enumerate(SENTENCES):
        alone = model.generate(
            **encode(model, tokenizer, [text]), num_beams=1, max_new_tokens=steps, min_new_tokens=steps
        )
        assert torch.equal(alone[0], sequences[row]), row


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_train_mode_is_eval_mode_but_dropout(tokenizer, setting):
    no_dropout = build(tokenizer, setting)
    inputs = encode(no_dropout, tokenizer, SENTENCES, targets=TARGETS)
    with torch.no_grad():
        evaluated = no_dropout(**inputs)
        trained = no_dropout.train()(**inputs)
    assert torch.allclose(trained.logits, evaluated.logits, atol=1e-6)
    assert torch.allclose(trained.loss, evaluated.loss, atol=1e-6)
    # the same weights with the small preset's dropout: training mode differs, eval mode is the dropout-free model
    dropout = build(tokenizer, setting, dropout=0.3, attention_dropout=0.3, activation_dropout=0.3)
    dropout.load_state_dict(no_dropout.state_dict())
    with torch.no_grad():
        torch.manual_seed(1)
        assert not torch.allclose(dropout.train()(**inputs).logits, evaluated.logits, atol=1e-3)
        assert torch.allclose(dropout.eval()(**inputs).logits, evaluated.logits, atol=1e-6)


@pytest.fixture
def analysis(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = importlib.import_module("mgsa_analysis")
    yield module
    sys.modules.pop("mgsa_analysis", None)


def test_smoothed_loss_splits_into_nll_and_uniform_term(tokenizer, analysis):
    """The analysis script's split of the tables' valid loss: (1 - eps) NLL + eps U equals the label-smoothed
    translation loss the trainer reports (`external.translation_loss`), and the entropy / NLL are those of p."""
    model = build(tokenizer, "ngram_san_onlstm", label_smoothing=0.1)  # the recipe's smoothing
    inputs = encode(model, tokenizer, SENTENCES, targets=TARGETS)
    with torch.no_grad():
        out = model(**inputs, smoothing=0.1)  # the smoothed loss, as the trainer asks for it
    labels = inputs["labels"]
    stats = analysis.TokenStats()
    stats.add(out.logits, labels)
    means = stats.means(0.1)
    assert means["tokens"] == int((labels != -100).sum())
    reported = float(external.translation_loss(model, out, labels, 0.1))  # the valid loss of the tables
    assert means["smoothed"] == pytest.approx(reported, abs=1e-5)
    flat_logits, flat_labels = out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1)
    assert means["nll"] == pytest.approx(float(F.cross_entropy(flat_logits, flat_labels, ignore_index=-100)), abs=1e-5)
    assert means["nll"] < reported  # smoothing adds eps * (U - NLL) > 0 here
    logp = torch.log_softmax(out.logits[labels != -100].float(), -1)
    assert means["entropy"] == pytest.approx(float(-(logp.exp() * logp).sum(-1).mean()), abs=1e-5)
    assert 0 < means["entropy"] <= math.log(model.config.vocab_size) + 1e-5


def test_analysis_translation_metrics_by_hand(analysis):
    refs = ["Ein Mann fährt Fahrrad .", "Zwei Hunde spielen im Schnee .", "Eine Frau liest ein Buch ."]
    sources = ["A man rides a bike .", "Two dogs play in the snow .", "A woman reads a book ."]
    same = analysis.translation_report(refs, sources, refs, tokenizer=None)
    assert same["bleu"] == pytest.approx(100.0) and same["bp"] == 1.0 and same["ratio"] == 1.0
    assert same["empty"] == 0 and same["at_limit"] == 0 and same["repeated_3gram"] == 0
    looping = "Ein Mann fährt Fahrrad " * 6  # 24 words + </s>: over int(1.2 * (6 + 1) + 10) = 18 new tokens
    hyps = ["Ein Mann fährt .", "", looping]
    got = analysis.translation_report(hyps, sources, refs, tokenizer=None)
    assert got["empty"] == pytest.approx(1 / 3) and got["at_limit"] == pytest.approx(1 / 3)
    assert got["repeated_3gram"] == pytest.approx(1 / 3)
    sys_len, ref_len = 4 + 0 + 24, 5 + 6 + 6  # 13a tokens
    assert (got["sys_len"], got["ref_len"]) == (sys_len, ref_len) and got["ratio"] == pytest.approx(sys_len / ref_len)
    short = analysis.translation_report(["Ein Mann .", "Zwei Hunde .", "Eine Frau ."], sources, refs, None)
    assert short["bp"] == pytest.approx(math.exp(1 - 17 / 9))  # brevity penalty exp(1 - r / c)
    assert sum(b["count"] for b in short["buckets"]) == 3


def test_analysis_leave_one_out_residuals(analysis):
    # BLEU = 50 - 5 * loss for all but one run, which is 2 BLEU below its prediction
    rows = {f"r{i}": (3.0 + 0.05 * i, 50 - 5 * (3.0 + 0.05 * i) + 0.1 * (-1) ** i) for i in range(6)}
    rows["odd"] = (3.1, 50 - 5 * 3.1 - 2.0)
    fits = analysis.leave_one_out(rows)
    assert fits["odd"]["predicted"] == pytest.approx(50 - 5 * 3.1, abs=0.15)
    assert fits["odd"]["residual"] == pytest.approx(-2.0, abs=0.15)
    assert fits["odd"]["residual"] / fits["odd"]["spread"] < -10
    assert all(abs(f["residual"]) < 1.0 for name, f in fits.items() if name != "odd")


def test_analysis_checks_the_code_of_another_tree(analysis):
    """`--check_tree` runs the invariance checks in a child process on a tree's own hf_variants (here this one)."""
    report = analysis.check_tree(ROOT)
    values = [float(v) for v in re.findall(r"max \|diff\| ([0-9.e+-]+)", report)]
    assert len(values) == 4 and max(values) < 1e-4, report
    assert str(ROOT) in report
