"""The transformers versions the models run on (`hf_variants/compat_transformer_nmt.py`): the declared range is the
checked one, a version outside it is named in one warning, a version known to decode wrongly is refused, the cache
travels under either name, and a model saved under one supported version decodes token-identically under the
other (with `HF_VARIANTS_OTHER_TRANSFORMERS_PYTHON`, an interpreter with the other version; `.ci/run` sets it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tomllib
import torch
import transformers
from conftest import REPO_ROOT, run_without_package

from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration
from hf_variants import compat_transformer_nmt as compat

OTHER_PYTHON = os.environ.get("HF_VARIANTS_OTHER_TRANSFORMERS_PYTHON")
REQUIRED = os.environ.get("HF_VARIANTS_REQUIRE_VERSION_MATRIX") == "1"


def test_declared_range_is_the_checked_range():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    (spec,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("transformers")]
    assert spec == "transformers" + ",".join(compat.SUPPORTED_RANGE)
    assert compat.is_supported(transformers.__version__), "the suite runs on a version outside the declared range"
    assert compat.is_supported("5.23.0") and compat.is_supported("5.24.3") and compat.is_supported("5.24.0.dev0")
    assert compat.is_supported("5.25.0") and compat.is_supported("5.25.2")
    assert not compat.is_supported("5.22.2") and not compat.is_supported("5.26.0") and not compat.is_supported("6.0")


def test_outside_the_range_one_warning_names_range_and_version():
    """A real process whose transformers says 5.22.0: importing the package and loading a config warn once."""
    code = """
        import warnings
        warnings.simplefilter("always")
        import transformers
        transformers.__version__ = "5.22.0"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import hf_variants
            from hf_variants import MuteConfig, TransformerNmtForConditionalGeneration
            from hf_variants import compat_transformer_nmt as compat
            compat.warn_if_unsupported()
        print([str(w.message) for w in caught if "tested with transformers" in str(w.message)])
    """
    result = subprocess.run(
        [sys.executable, "-c", __import__("textwrap").dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (message,) = eval(result.stdout.strip().splitlines()[-1])
    assert ">=5.23,<5.26" in message and "5.22.0" in message


def test_supported_version_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.warn_if_unsupported("5.24.0") is False
        assert compat.warn_if_unsupported("5.23.1") is False


def test_known_wrong_version_refuses_to_generate(monkeypatch):
    torch.manual_seed(0)
    model = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset("tiny", vocab_size=40)).eval()
    ids = torch.tensor([[5, 6, 7, 2]])
    assert model.generate(ids, max_new_tokens=3).shape[0] == 1
    running = transformers.__version__
    monkeypatch.setattr(compat, "KNOWN_WRONG", {running: "beam search reorders the cache twice"})
    with pytest.raises(RuntimeError, match=f"transformers {running} decodes hf_variants' models wrongly"):
        model.generate(ids, max_new_tokens=3)
    minor = ".".join(running.split(".")[:2])
    monkeypatch.setattr(compat, "KNOWN_WRONG", {minor: "a whole minor"})
    with pytest.raises(RuntimeError, match="a whole minor"):
        model.generate(ids, max_new_tokens=3)
    monkeypatch.setattr(compat, "KNOWN_WRONG", {"5.22.1": "another release"})
    assert model.generate(ids, max_new_tokens=3).shape[0] == 1


def test_cache_under_either_name():
    """`cache=` and the older `past_key_values=` give the same cached step; both at once are refused."""
    torch.manual_seed(0)
    model = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset("tiny", vocab_size=40)).eval()
    source, start = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[0, 9, 11]])
    outputs = {}
    for name in ("cache", "past_key_values"):
        first = model(input_ids=source, decoder_input_ids=start, use_cache=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # past_key_values from transformers 5.24 on
            step = model(
                input_ids=source, decoder_input_ids=torch.tensor([[12]]), **{name: compat.output_cache(first)}
            )
        outputs[name] = step.logits
        assert compat.output_cache(step).get_seq_length() == 4
    torch.testing.assert_close(outputs["cache"], outputs["past_key_values"], rtol=0, atol=0)
    full = model(input_ids=source, decoder_input_ids=torch.tensor([[0, 9, 11, 12]])).logits[:, -1:]
    torch.testing.assert_close(outputs["cache"], full, rtol=1e-5, atol=1e-5)
    first = model(input_ids=source, decoder_input_ids=start, use_cache=True)
    other = model(input_ids=source, decoder_input_ids=start, use_cache=True)
    with pytest.raises(ValueError, match="not both"):
        model(
            input_ids=source,
            decoder_input_ids=torch.tensor([[12]]),
            cache=compat.output_cache(first),
            past_key_values=compat.output_cache(other),
        )


def test_the_mask_helpers_get_the_cache_under_its_current_name():
    """The mask helpers' cache keyword is the running version's cache name (5.25 also lists the deprecated
    `past_key_values` in their signatures): a cached decoding step builds its masks without a deprecation warning."""
    assert compat._MASK_CACHE_ARG == compat.CACHE_NAME
    torch.manual_seed(0)
    model = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset("tiny", vocab_size=40)).eval()
    source = torch.tensor([[5, 6, 7, 2]])
    first = model(input_ids=source, decoder_input_ids=torch.tensor([[0, 9]]), use_cache=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = model(
            input_ids=source, decoder_input_ids=torch.tensor([[11]]), **compat.cache_field(compat.output_cache(first))
        )
    full = model(input_ids=source, decoder_input_ids=torch.tensor([[0, 9, 11]])).logits[:, -1:]
    torch.testing.assert_close(step.logits, full, rtol=1e-5, atol=1e-5)


def test_loading_needs_no_hub_kernels(tmp_path, monkeypatch):
    """`from_pretrained` does not apply Hub kernels unless asked (transformers 5.25 does by default, and then needs
    the `kernels` package): a load where `kernels` is unavailable works and gives the same model."""
    import transformers.modeling_utils as modeling_utils

    torch.manual_seed(0)
    model = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset("tiny", vocab_size=40)).eval()
    model.save_pretrained(tmp_path)
    monkeypatch.setattr(modeling_utils, "is_kernels_available", lambda: False, raising=False)
    loaded = TransformerNmtForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert loaded.use_kernels is False
    ids = torch.tensor([[5, 6, 7, 2]])
    assert torch.equal(loaded.generate(ids, max_new_tokens=4), model.generate(ids, max_new_tokens=4))
    assert compat.without_hub_kernels({"use_kernels": True}) == {"use_kernels": True}  # asked: transformers decides


def _run(python: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    script = str(Path(__file__).with_name("cross_version.py"))
    result = subprocess.run([python, script, *args], capture_output=True, text=True, timeout=600, env=env)
    if result.returncode != 0:
        raise AssertionError(f"{python} {' '.join(args)} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _load_without_package(folder: Path) -> dict:
    code = f"""
        import json, runpy, sys
        sys.argv = ["cross_version.py", "load", {str(folder)!r}]
        module = runpy.run_path({str(Path(__file__).with_name("cross_version.py"))!r})
        print(json.dumps(module["load"]({str(folder)!r})))
    """
    return json.loads(run_without_package(code, timeout=600).strip().splitlines()[-1])


@pytest.mark.skipif(
    OTHER_PYTHON is None and not REQUIRED,
    reason="needs a second interpreter with the other supported transformers: set "
    "HF_VARIANTS_OTHER_TRANSFORMERS_PYTHON (.ci/run sets it to its transformers 5.23 environment)",
)
def test_saved_under_one_version_decodes_identically_under_the_other(tokenizer, tmp_path):
    """Every model type, greedy and beam: saved under this process's transformers and decoded under the other one
    (through the saved code, `trust_remote_code`), and the reverse."""
    assert OTHER_PYTHON, "HF_VARIANTS_REQUIRE_VERSION_MATRIX=1 but HF_VARIANTS_OTHER_TRANSFORMERS_PYTHON is not set"
    other_version = subprocess.run(
        [OTHER_PYTHON, "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert other_version != transformers.__version__ and compat.is_supported(other_version), other_version
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    # saved here, decoded there
    here = _run(sys.executable, "save", str(tmp_path / "tokenizer"), str(tmp_path / "here"))
    there = _run(OTHER_PYTHON, "load", str(tmp_path / "here"))
    assert (here["transformers"], there["transformers"]) == (transformers.__version__, other_version)
    assert there["ids"] == here["ids"]
    # saved there, decoded here
    saved_there = _run(OTHER_PYTHON, "save", str(tmp_path / "tokenizer"), str(tmp_path / "there"))
    config = json.loads((tmp_path / "there" / "mute_nmt" / "config.json").read_text())
    assert config["transformers_version"] == other_version
    decoded_here = _load_without_package(tmp_path / "there")
    assert decoded_here["ids"] == saved_there["ids"]
    # and the two versions agree with each other on the same weights
    assert saved_there["ids"] == here["ids"]
    assert any(len(set(map(tuple, ids))) > 1 for per_type in here["ids"].values() for ids in per_type.values())


def test_every_internal_names_existing_guarding_tests():
    """docs/transformers-internals.md: every row names at least one guarding test, and every test it names as
    `file.py::name` exists (a renamed test would leave an internal unguarded without anyone noticing)."""
    import re

    doc = (REPO_ROOT / "docs" / "transformers-internals.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| ") and not line.startswith("| internal")]
    rows = [row for row in rows if not set(row) <= set("|- ")]
    assert len(rows) >= 12
    named = 0
    for row in rows:
        guards = row.rstrip(" |").rsplit("|", 1)[-1]
        references = re.findall(r"`([\w.]+\.py)::(\w+)`", guards)
        assert references or "peer" in guards, row
        last_file = None
        for file, name in references:
            last_file = file
            source = (REPO_ROOT / "modeling_tests" / file).read_text()
            assert re.search(rf"def {name}\(", source), f"{file}::{name} (in docs/transformers-internals.md)"
            named += 1
        for name in re.findall(r"`::(\w+)`", guards):  # `::name` continues the previous file
            assert last_file and re.search(rf"def {name}\(", (REPO_ROOT / "modeling_tests" / last_file).read_text())
            named += 1
    assert named >= 20
