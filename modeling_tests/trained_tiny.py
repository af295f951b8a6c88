"""A tiny baseline trained for a few seconds on bundled Multi30k pairs (en -> de), shared by the int8 and the
CTranslate2 export tests: its greedy outputs are confident and non-trivial (varied real-looking German tokens),
unlike a random model's near-ties, so exact token-for-token comparisons between engines mean something."""

from __future__ import annotations

import copy

import torch
from conftest import read_sentences

from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration

_CACHE: dict = {}


def trained_baseline(tokenizer, steps: int = 300, **overrides) -> TransformerNmtForConditionalGeneration:
    """A fresh copy of the tiny baseline (config `overrides`) after `steps` Adam steps on 200 sentence pairs
    (batches of 25, at most 24 tokens). Trained once per tokenizer and settings in a test session."""
    key = (id(tokenizer), steps, tuple(sorted(overrides.items())))
    if key not in _CACHE:
        torch.manual_seed(0)
        config = TransformerNmtConfig.from_preset("tiny", vocab_size=len(tokenizer), dropout=0.0, **overrides)
        model = TransformerNmtForConditionalGeneration(config)
        sources, targets = read_sentences("en", n=200), read_sentences("de", n=200)
        batches = [
            model.prepare_translation_inputs(
                tokenizer, sources[i : i + 25], text_target=targets[i : i + 25], max_length=24
            )
            for i in range(0, 200, 25)
        ]
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        model.train()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a tiny model gains nothing from a second thread, and loses a lot on a busy CPU
        try:
            for step in range(steps):
                model(**batches[step % len(batches)]).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        finally:
            torch.set_num_threads(threads)
        _CACHE[key] = model.eval()
    return copy.deepcopy(_CACHE[key])


def en_de_baseline(tokenizer, **overrides) -> TransformerNmtForConditionalGeneration:
    """`trained_baseline` with its direction recorded, en -> de (what the command and server tests translate)."""
    model = trained_baseline(tokenizer, **overrides)
    model.config.languages, model.config.target_languages = ["en", "de"], ["de"]
    return model


def save_en_de_baseline(tokenizer, folder) -> TransformerNmtForConditionalGeneration:
    """`en_de_baseline` saved with the tokenizer into `folder` (a model folder the commands load); the model."""
    model = en_de_baseline(tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def one_torch_thread():
    """torch on one thread for the duration (a module's autouse fixture: `pytest.fixture(scope="module",
    autouse=True)(one_torch_thread)`): a tiny model gains nothing from a second thread, and loses a lot on a busy
    CPU; the setting before is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trained_tiny(model_class, config_class, tokenizer, steps: int = 30, tgt_lang: str | None = None, **overrides):
    """A fresh copy of a tiny model of any type (config `overrides`) after `steps` Adam steps on 200 en -> de pairs,
    so that its scores are not uniform (a random model's near-ties would make score comparisons meaningless).
    `tgt_lang`: the target language the training batches name (multilingual models). Trained once per tokenizer,
    class and settings in a test session."""
    key = (id(tokenizer), model_class.__name__, steps, tgt_lang, repr(sorted(overrides.items())))
    if key not in _CACHE:
        torch.manual_seed(0)
        config = config_class.from_preset(
            "tiny",
            vocab_size=len(tokenizer),
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            **overrides,
        )
        model = model_class(config)
        sources, targets = read_sentences("en", n=200), read_sentences("de", n=200)
        kwargs = {"tgt_lang": tgt_lang} if tgt_lang else {}
        batches = [
            model.prepare_translation_inputs(
                tokenizer, sources[i : i + 25], text_target=targets[i : i + 25], max_length=24, **kwargs
            )
            for i in range(0, 200, 25)
        ]
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        model.train()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for step in range(steps):
                model(**batches[step % len(batches)]).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        finally:
            torch.set_num_threads(threads)
        _CACHE[key] = model.eval()
    return copy.deepcopy(_CACHE[key])
