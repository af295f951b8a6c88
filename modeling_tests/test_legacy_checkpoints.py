"""Models saved before the conformance rework (fixtures/legacy, saved by hf_variants 0.1 at commit 4652af5) keep
working: with today's code they give the logits they gave then (1e-5), through the Auto classes in-process and
through trust_remote_code in a fresh process. MUTE and MIMO changed their weight layout (per-unit nn.Linear
modules): their folders load after `python -m hf_variants.convert_legacy`, and loading one unconverted raises a
ValueError that names the command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_without_package
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM

import hf_variants
from hf_variants.convert.legacy import convert_checkpoint

FIXTURES = Path(__file__).parent / "fixtures" / "legacy"
UNCHANGED = ["transformer_nmt", "hysan_nmt", "mgsa_nmt", "tied_nmt"]
CONVERTED = ["mute_nmt", "mimo_nmt"]


def expected(name: str) -> tuple[dict, torch.Tensor]:
    tensors = load_file(FIXTURES / name / "expected.safetensors")
    logits = tensors.pop("logits")
    return tensors, logits


def model_folder(name: str, tmp_path: Path) -> Path:
    """The fixture's weights and config with today's code beside them (as `save_pretrained` writes it), the way a
    Hub repository updated to today's code looks; converted first for the types whose layout changed."""
    folder = tmp_path / name
    if name in CONVERTED:
        convert_checkpoint(FIXTURES / name, folder)
    else:
        shutil.copytree(FIXTURES / name, folder)
        model = AutoModelForSeq2SeqLM.from_pretrained(folder)
        model.save_pretrained(tmp_path / "code")  # writes today's code files next to a copy
        for code in (tmp_path / "code").glob("*.py"):
            shutil.copy2(code, folder / code.name)
        config = json.loads((tmp_path / "code" / "config.json").read_text())
        saved = json.loads((folder / "config.json").read_text())
        saved["auto_map"] = config["auto_map"]
        (folder / "config.json").write_text(json.dumps(saved, indent=2))
    return folder


@pytest.mark.parametrize("name", UNCHANGED)
def test_old_checkpoint_loads_in_process(name):
    inputs, logits = expected(name)
    model = AutoModelForSeq2SeqLM.from_pretrained(FIXTURES / name).eval()
    assert type(model) is hf_variants.MODEL_CLASSES[name][2]
    with torch.no_grad():
        assert torch.allclose(model(**inputs).logits, logits, atol=1e-5)


@pytest.mark.parametrize("name", CONVERTED)
def test_old_stacked_checkpoint_names_the_conversion(name):
    with pytest.raises(ValueError, match="convert_legacy"):
        AutoModelForSeq2SeqLM.from_pretrained(FIXTURES / name)


@pytest.mark.parametrize("name", CONVERTED)
def test_converted_checkpoint_gives_the_old_logits(name, tmp_path):
    inputs, logits = expected(name)
    convert_checkpoint(FIXTURES / name, tmp_path / "converted")
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "converted").eval()
    with torch.no_grad():
        assert torch.allclose(model(**inputs).logits, logits, atol=1e-5)


def test_old_checkpoints_load_with_trust_remote_code(tmp_path):
    """Every type, in one fresh process without hf_variants: today's code files beside the old (or converted)
    weights, loaded with `trust_remote_code=True`."""
    folders = {name: str(model_folder(name, tmp_path)) for name in UNCHANGED + CONVERTED}
    code = f"""
        import json, torch
        from safetensors.torch import load_file
        from transformers import AutoModelForSeq2SeqLM
        diffs = {{}}
        for name, folder in {folders!r}.items():
            tensors = load_file({str(FIXTURES)!r} + "/" + name + "/expected.safetensors")
            logits = tensors.pop("logits")
            model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            with torch.no_grad():
                diffs[name] = (model(**tensors).logits - logits).abs().max().item()
        print(json.dumps(diffs))
    """
    diffs = json.loads(run_without_package(code).strip().splitlines()[-1])
    assert set(diffs) == set(UNCHANGED + CONVERTED)
    assert all(diff < 1e-5 for diff in diffs.values()), diffs
