"""CTranslate2 export (`python -m hf_variants.export_ctranslate2`): CTranslate2 decodes a trained baseline exactly
as we do, scores every exportable configuration with our log-probabilities, loads int8 exports, and refuses what it
cannot express with the field named."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, read_sentences
from trained_tiny import trained_baseline

from hf_variants import HysanConfig, TransformerNmtConfig, TransformerNmtForConditionalGeneration
from hf_variants.deploy.ctranslate2 import check_exportable, export

ctranslate2 = pytest.importorskip(
    "ctranslate2", reason="ctranslate2 is not installed: pip install 'hf-variants[deploy]'"
)


def translator(path, compute_type="float32"):
    return ctranslate2.Translator(str(path), device="cpu", compute_type=compute_type, intra_threads=1)


def source_tokens(tokenizer, sentences):
    return [tokenizer.convert_ids_to_tokens(ids) for ids in tokenizer(sentences)["input_ids"]]


def our_greedy_tokens(model, tokenizer, sentences, max_new_tokens=30):
    with torch.no_grad():
        out = model.generate(
            **model.prepare_translation_inputs(tokenizer, sentences), num_beams=1, max_new_tokens=max_new_tokens
        )
    hyps = []
    for row in out[:, 1:].tolist():  # drop the start token; cut at </s> (CTranslate2 does not return it)
        row = row[: row.index(model.config.eos_token_id)] if model.config.eos_token_id in row else row
        hyps.append(tokenizer.convert_ids_to_tokens(row))
    return hyps


def test_greedy_output_equals_ours_token_for_token(tokenizer, tmp_path):
    model = trained_baseline(tokenizer)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    from hf_variants.commands.export_ctranslate2 import main

    out = main(["--model", str(tmp_path / "model"), "--output_dir", str(tmp_path / "ct2")])
    suppress = json.loads((out / "hf_variants_export.json").read_text())["suppress_sequences"]
    assert sorted(suppress) == [["<pad>"], ["<s>"]]
    sentences = read_sentences("en", "val", n=24)
    ours = our_greedy_tokens(model, tokenizer, sentences)
    results = translator(out).translate_batch(
        source_tokens(tokenizer, sentences), beam_size=1, max_decoding_length=30, suppress_sequences=suppress
    )
    assert [r.hypotheses[0] for r in results] == ours
    assert len({" ".join(h) for h in ours}) > 12 and sum(map(len, ours)) > 24 * 8  # non-trivial outputs


# mean |int8 - fp32| log-probability per token of the trained tiny model's fp32 greedy output under CTranslate2:
# 0.80 measured (its int8 mode quantizes the embeddings too, and d_model is 32); quantize_for_cpu: 0.052 on the same
INT8_LOGPROB_TOL = 1.2


def test_int8_export_loads_and_translates(tokenizer, tmp_path):
    """`--quantization int8` through the command line: int8 weights on disk, and CTranslate2 translates with them
    (first tokens as fp32's: the trained model is confident there)."""
    model = trained_baseline(tokenizer)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for name, extra in (("fp32", []), ("int8", ["--quantization", "int8"])):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "hf_variants.export_ctranslate2",
                "--model",
                str(tmp_path / "model"),
                "--output_dir",
                str(tmp_path / name),
                *extra,
            ],
            check=True,
            env=env,
            capture_output=True,
            timeout=300,
        )
    assert (tmp_path / "int8" / "model.bin").stat().st_size < 0.5 * (tmp_path / "fp32" / "model.bin").stat().st_size
    sentences = read_sentences("en", "val", n=16)
    kwargs = dict(beam_size=1, max_decoding_length=30, suppress_sequences=[["<pad>"], ["<s>"]])
    int8 = translator(tmp_path / "int8", "int8").translate_batch(source_tokens(tokenizer, sentences), **kwargs)
    ours = our_greedy_tokens(model, tokenizer, sentences)
    assert all(r.hypotheses[0] for r in int8)
    # int8 scores of our fp32 translations stay near fp32's (a tiny model's near-ties let int8 pick other tokens)
    fp32_scores = translator(tmp_path / "fp32").score_batch(source_tokens(tokenizer, sentences), ours)
    int8_scores = translator(tmp_path / "int8", "int8").score_batch(source_tokens(tokenizer, sentences), ours)
    diffs = torch.cat(
        [torch.tensor(a.log_probs) - torch.tensor(b.log_probs) for a, b in zip(int8_scores, fp32_scores)]
    )
    assert 0 < diffs.abs().mean() <= INT8_LOGPROB_TOL


CONFIGS = {
    "post-norm, sinusoidal, shared + tied": {},
    "pre-norm, learned positions, separate embeddings, untied output with bias, gelu": dict(
        normalize_before=True,
        position_embedding_type="learned",
        share_encoder_decoder_embeddings=False,
        tie_word_embeddings=False,
        output_bias=True,
        activation_function="gelu",
    ),
    "relative keys, no absolute positions, unscaled embeddings": dict(
        position_embedding_type="none", max_relative_positions=3, scale_embedding=False
    ),
    "relative keys and values, pre-norm, 3 decoder layers": dict(
        position_embedding_type="none",
        max_relative_positions=2,
        relative_position_values=True,
        normalize_before=True,
        decoder_layers=3,
        decoder_ffn_dim=48,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_scores_equal_ours_for_every_exportable_configuration(name, tokenizer, tmp_path):
    """CTranslate2's log-probabilities of given targets = ours (random weights: every parameter counts)."""
    torch.manual_seed(0)
    config = TransformerNmtConfig.from_preset("tiny", vocab_size=len(tokenizer), **CONFIGS[name])
    model = TransformerNmtForConditionalGeneration(config).eval()
    with torch.no_grad():  # random biases and norms too, so that a dropped or misplaced one shows
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    out = export(model, tokenizer, tmp_path / "ct2")
    sources = read_sentences("en", "val", n=6)
    targets = read_sentences("de", "val", n=6)
    target_tokens = [tokenizer.convert_ids_to_tokens(ids[:-1]) for ids in tokenizer(targets)["input_ids"]]
    scored = translator(out).score_batch(source_tokens(tokenizer, sources), target_tokens)
    inputs = model.prepare_translation_inputs(tokenizer, sources, text_target=targets)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(**inputs).logits, dim=-1)
    for row, result in enumerate(scored):
        labels = inputs["labels"][row][inputs["labels"][row] != -100]  # target tokens + </s>, as CTranslate2 scores
        ours = logprobs[row, : len(labels)].gather(-1, labels[:, None])[:, 0]
        assert len(result.log_probs) == len(labels)
        assert torch.allclose(torch.tensor(result.log_probs), ours, atol=1e-4), (row, result.log_probs, ours)


def test_inexpressible_configurations_name_the_field(tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"model_type='hysan_nmt'.*masked branches"):
        check_exportable(HysanConfig.from_preset("tiny", vocab_size=100))
    with pytest.raises(ValueError, match="activation_function='relu6'"):
        check_exportable(TransformerNmtConfig.from_preset("tiny", vocab_size=100, activation_function="relu6"))
    with pytest.raises(ValueError, match="position_embedding_type must be 'none'"):
        check_exportable(TransformerNmtConfig.from_preset("tiny", vocab_size=100, max_relative_positions=4))
    model = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset("tiny", vocab_size=len(tokenizer)))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="--force"):
        export(model, tokenizer, tmp_path / "taken")
    small = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset("tiny", vocab_size=100))
    with pytest.raises(ValueError, match=r"has 500 tokens .* vocabulary of 100 \(config.vocab_size\)"):
        export(small, tokenizer, tmp_path / "small")
