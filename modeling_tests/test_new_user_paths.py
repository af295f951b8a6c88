"""Paths a new user takes first (issue 32's papercuts): after `import hf_variants`, `pipeline("translation",
model=FOLDER)` loads a saved folder without `trust_remote_code` (as `AutoModelForSeq2SeqLM.from_pretrained` does),
and greedy translation with `training/translate.py --num_beams 1` on a model saved with the papers' beam settings
passes no length penalty (generate() warned "generation flags are not valid ... ['length_penalty']")."""

from __future__ import annotations

import json
import sys

import torch
from conftest import REPO_ROOT, read_sentences
from transformers import pipeline
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

import hf_variants  # noqa: F401  (registers the model types and the translation task)
from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration

sys.path.insert(0, str(REPO_ROOT))
from hf_variants.training import translate  # noqa: E402


def saved_model(tokenizer, path):
    torch.manual_seed(0)
    model = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset("tiny", vocab_size=len(tokenizer)))
    model.generation_config.num_beams, model.generation_config.length_penalty = 4, 0.6  # what train.py saves
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()


def test_pipeline_loads_a_folder_without_trust_remote_code(tokenizer, tmp_path):
    model = saved_model(tokenizer, tmp_path / "model")
    sentences = read_sentences("en", "val", n=3)
    by_path = pipeline("translation", model=str(tmp_path / "model"))
    assert type(by_path.model) is TransformerNmtForConditionalGeneration
    expected = pipeline("translation", model=model, tokenizer=tokenizer)(sentences, max_new_tokens=8)
    assert by_path(sentences, max_new_tokens=8) == expected
    # the saved config still ships the remote-code pipeline (for processes without the package)
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert saved["custom_pipelines"]["translation"]["impl"] == "pipeline_translation.TranslationPipeline"
    assert model.config.custom_pipelines == {}  # in this process the registered task serves it


def test_greedy_translate_passes_no_length_penalty(tokenizer, tmp_path):
    model = saved_model(tokenizer, tmp_path / "model")
    src = tmp_path / "src.en"
    src.write_text("\n".join(read_sentences("en", "val", n=2)) + "\n")
    logger = hf_logging.get_logger("transformers.generation.configuration_utils")  # where generate() validates
    logger.warning_once.cache_clear()  # the warning is emitted once per process
    with CaptureLogger(logger) as captured:
        translate.main(
            [
                "--model",
                str(tmp_path / "model"),
                "--input",
                str(src),
                "--output",
                str(tmp_path / "out"),
                "--num_beams",
                "1",
                "--no_progress",
            ]
        )
    assert "length_penalty" not in captured.out
    # what translate.py passed before: the same call with the length penalty warns (the check above can fail)
    logger.warning_once.cache_clear()
    inputs = model.prepare_translation_inputs(tokenizer, read_sentences("en", "val", n=1))
    with CaptureLogger(logger) as captured:
        model.generate(**inputs, num_beams=1, length_penalty=0.6, max_new_tokens=3)
    assert "['length_penalty']" in captured.out
