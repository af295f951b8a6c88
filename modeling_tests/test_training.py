"""Tests of training/train.py and training/translate.py: tiny real runs of every model type, resume after SIGKILL,
2-process training, bad data, auxiliary losses, checkpoint averaging, atomic checkpoints, the offline metric."""

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import sacrebleu
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers import AutoTokenizer  # noqa: E402

from hf_variants import TransformerNmtConfig  # noqa: E402
from hf_variants.tokenization import train_tokenizer  # noqa: E402
from hf_variants.training import best_checkpoints, checkpointing, evaluation, train  # noqa: E402
from hf_variants.training.corpus import DataError  # noqa: E402
from hf_variants.training.settings import SettingsChangedError  # noqa: E402

MULTI30K = ROOT / "training" / "data" / "multi30k"
TRAIN_SCRIPT = ROOT / "training" / "train.py"
TRANSLATE_SCRIPT = ROOT / "training" / "translate.py"
AUX_LOSS_TYPES = {"mute_nmt", "mgsa_nmt"}
ALL_TYPES = ["transformer_nmt", "mute_nmt", "hysan_nmt", "mgsa_nmt", "mimo_nmt", "tied_nmt"]


def head(path, n):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for _, line in zip(range(n), f)]


def write_lines(path: Path, lines):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A small slice of the bundled Multi30k (en, de, fr): 300 training, 30 validation and 30 test rows."""
    d = tmp_path_factory.mktemp("multi30k_small")
    for split, n in (("train", 300), ("val", 30), ("test_2016_flickr", 30)):
        for lang in ("en", "de", "fr"):
            write_lines(d / f"{split}.{lang}.gz", head(MULTI30K / f"{split}.{lang}.gz", n))
    return d


@pytest.fixture(scope="module")
def tokenizer_dir(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(
        [data_dir / f"train.{lang}.gz" for lang in ("en", "de", "fr")],
        vocab_size=600,
        languages=["en", "de", "fr"],
        output_dir=out,
    )
    return out


def tiny_args(data_dir, out, *extra, tokenizer=None, steps=24):
    args = [
        "--data_dir",
        str(data_dir),
        "--preset",
        "tiny",
        "--max_steps",
        str(steps),
        "--max_tokens",
        "1024",
        "--warmup_steps",
        "4",
        "--learning_rate",
        "3e-3",
        "--eval_steps",
        "12",
        "--eval_bleu_pairs",
        "8",
        "--num_beams",
        "2",
        "--max_len_a",
        "1.0",
        "--max_len_b",
        "4",
        "--logging_steps",
        "4",
        "--eval_batch_size",
        "32",
        "--output_dir",
        str(out),
        "--num_examples",
        "2",
    ]
    if tokenizer is not None:
        args += ["--tokenizer", str(tokenizer)]
    return args + list(extra)


def read_log(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "log.jsonl").read_text().splitlines()]


def train_losses(run_dir):
    return {r["step"]: r["loss"] for r in read_log(run_dir) if "loss" in r}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_process_launch(*train_args) -> list[str]:
    """`accelerate launch` of train.py as 2 CPU processes (gloo) on a free port, with `train_args`."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        str(TRAIN_SCRIPT),
        *train_args,
    ]


def subprocess_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


# ------------------------------------------------------------------------------------------------ the metric
def test_offline_metric_matches_sacrebleu():
    hyps = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest"]
    refs = ["Ein Mann fährt mit dem Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch."]
    result = evaluation.score(hyps, refs)
    assert result["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert result["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)
    assert result["sacrebleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert "version:" in result["chrf_signature"]


# ---------------------------------------------------------------------------------------- checkpoint helpers
def test_incomplete_checkpoints_are_ignored(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for step, complete in ((2, True), (4, True), (6, False)):
        (ckpt / f"step_{step}").mkdir(parents=True)
        if complete:
            marker = {"step": step, "format": checkpointing.FORMAT_VERSION}  # the current, pickle-free format
            (ckpt / f"step_{step}" / checkpointing.MARKER).write_text(json.dumps(marker))
    (ckpt / ".tmp_step_8").mkdir()  # a save killed before its rename
    assert [s for s, _ in checkpointing.list_checkpoints(ckpt)] == [2, 4]
    assert checkpointing.resolve_resume("latest", ckpt).name == "step_4"
    assert checkpointing.resolve_resume("latest", tmp_path / "nothing") is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpointing.resolve_resume(str(ckpt / "step_6"), ckpt)
    # rotation keeps the newest --keep_checkpoints and the best, and deletes only checkpoints the run wrote
    state = SimpleNamespace(checkpoints=[2, 4], evals=[], best_step=2)
    args = SimpleNamespace(keep_checkpoints=1, average_last=0, keep_best=0, best_metric="bleu")
    best_checkpoints.rotate(ckpt, state, args)
    assert [s for s, _ in checkpointing.list_checkpoints(ckpt)] == [2, 4]
    state.best_step, state.checkpoints = None, [4]  # step_2 is no checkpoint of this run: kept
    best_checkpoints.rotate(ckpt, state, args)
    assert [s for s, _ in checkpointing.list_checkpoints(ckpt)] == [2, 4]
    state.checkpoints = [2, 4]
    best_checkpoints.rotate(ckpt, state, args)
    assert [s for s, _ in checkpointing.list_checkpoints(ckpt)] == [4] and state.checkpoints == [4]


@pytest.mark.parametrize("name", ["ddp", "fsdp", "multi_node"])
def test_accelerate_configs_parse(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "training" / "accelerate_configs" / f"{name}.yaml"))
    assert config.distributed_type.value == ("FSDP" if name == "fsdp" else "MULTI_GPU")
    assert config.num_machines == (2 if name == "multi_node" else 1)
    if name == "fsdp":
        assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"  # what averaging/translate read


def test_parse_overrides():
    assert train.parse_overrides("d_model=64,languages=['en','de'],normalize_before=true,init_method=normal") == {
        "d_model": 64,
        "languages": ["en", "de"],
        "normalize_before": True,
        "init_method": "normal",
    }


# ------------------------------------------------------------------------------------------- the baseline run
@pytest.fixture(scope="module")
def baseline_run(data_dir, tmp_path_factory):
    """The baseline trained from scratch, tokenizer included, with checkpoint averaging of the last 2."""
    out = tmp_path_factory.mktemp("runs") / "baseline"
    results = train.main(tiny_args(data_dir, out, "--save_steps", "6", "--average_last", "2", steps=30))
    return out, results


def test_baseline_run_outputs(baseline_run):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    run_dir, results = baseline_run
    assert results == json.loads((run_dir / "results.json").read_text())
    for key in (
        "model_type",
        "variant",
        "source_lang",
        "target_lang",
        "languages",
        "dataset",
        "eval_split",
        "bleu",
        "chrf",
        "sacrebleu_signature",
        "chrf_signature",
        "params",
        "train_tokens_per_sec",
        "wall_time_sec",
        "train_pairs",
        "dropped_pairs",
        "dropped_reasons",
        "steps",
        "epochs",
        "hyperparameters",
        "base_model",
        "per_direction",
    ):
        assert key in results, key
    assert results["model_type"] == "transformer_nmt" and results["steps"] == 30
    assert (results["source_lang"], results["target_lang"], results["eval_split"]) == ("en", "de", "test_2016_flickr")
    assert results["train_pairs"] == 300 and results["dropped_pairs"] == 0
    assert 0 <= results["bleu"] <= 100 and results["sacrebleu_signature"].startswith("nrefs:1")
    assert results["train_tokens_per_sec"] > 0 and results["params"] > 0
    # the shared tokenizer was trained and saved with the run; the final model reloads with from_pretrained
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()
    model = AutoModelForSeq2SeqLM.from_pretrained(run_dir / "model")
    tok = AutoTokenizer.from_pretrained(run_dir / "model")
    assert model.config.vocab_size == len(tok) and model.config.pad_token_id == tok.pad_token_id == 0
    assert tok.model_max_length == model.config.max_position_embeddings == 256  # the model's limit, not 1024
    assert sum(p.numel() for p in model.parameters()) == results["params"]
    lines = (run_dir / "translations.test.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 30
    # the model folder carries its card (written at the end of every run, not only with --push_to_hub)
    from huggingface_hub import ModelCard

    card = ModelCard.load(run_dir / "model" / "README.md")
    assert card.data.language == ["en", "de"] and card.data.library_name == "transformers"
    assert [(r.metric_type, r.metric_value) for r in card.data.eval_results] == [
        ("bleu", round(results["bleu"], 2)),
        ("chrf", round(results["chrf"], 2)),
    ]
    assert f"{results['params']:,}" in card.text and "ORG/NAME" in card.text  # no --hub_model_id: a placeholder


def test_baseline_loss_falls_and_no_aux_losses(baseline_run):
    run_dir, _ = baseline_run
    losses = train_losses(run_dir)
    steps = sorted(losses)
    assert steps[0] == 4 and steps[-1] == 30
    assert losses[steps[-1]] < losses[steps[0]] - 0.5, losses
    assert not any(k.startswith("aux/") for r in read_log(run_dir) for k in r)
    evals = [r for r in read_log(run_dir) if "valid_loss" in r]
    assert [r["step"] for r in evals] == [12, 24, 30] and evals[-1]["valid_loss"] < evals[0]["valid_loss"]


def test_average_last_is_mean_of_last_checkpoints(baseline_run):
    run_dir, results = baseline_run
    ckpts = checkpointing.list_checkpoints(run_dir / "checkpoints")
    assert [s for s, _ in ckpts][-2:] == [24, 30]
    assert results["final_model"] == "average of step_24, step_30"
    a, b = (checkpointing.load_weights(p) for _, p in ckpts[-2:])
    final = load_file(str(run_dir / "model" / "model.safetensors"))
    assert set(a) <= set(final)
    for name in a:
        assert torch.allclose(
            final[name], (a[name].double() + b[name].double()).div(2).to(a[name].dtype), atol=1e-6
        ), name
    assert any(not torch.equal(a[n], b[n]) for n in a)  # the two checkpoints differ: averaging did something


def test_translate_script(baseline_run, data_dir, tmp_path):
    run_dir, _ = baseline_run
    src = tmp_path / "src.en"
    sources = head(data_dir / "test_2016_flickr.en.gz", 12)
    sources[3] = ""  # an empty line keeps its place
    src.write_text("\n".join(sources) + "\n", encoding="utf-8")
    out = tmp_path / "hyp.de"
    refs = data_dir / "test_2016_flickr.de.gz"
    ref_lines = head(refs, 12)
    (tmp_path / "ref.de").write_text("\n".join(ref_lines) + "\n", encoding="utf-8")
    proc = subprocess.run(
        [
            sys.executable,
            str(TRANSLATE_SCRIPT),
            "--model",
            str(run_dir / "model"),
            "--input",
            str(src),
            "--output",
            str(out),
            "--references",
            str(tmp_path / "ref.de"),
            "--num_beams",
            "2",
            "--max_len_b",
            "4",
            "--results_json",
            str(tmp_path / "scores.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    hyps = out.read_text(encoding="utf-8").split("\n")[:-1]
    assert len(hyps) == 12 and hyps[3] == ""
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [ref_lines]).score)
    assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [ref_lines]).score)
    assert scores["empty_inputs"] == 1 and scores["sacrebleu_signature"].startswith("nrefs:1")
    # the translations are the model's: the same beam search in-process gives the same lines
    from hf_variants.commands.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(run_dir / "model"))
    # the command's length rule defaults to the one the run evaluated with, saved with the model (--max_len_a 1.0)
    direct = evaluation.translate(model, tok, [sources[0], sources[5]], "de", num_beams=2, max_len_a=1.0, max_len_b=4)
    assert direct == [hyps[0], hyps[5]]
    # a training checkpoint folder works as --model too
    ckpt = checkpointing.latest_checkpoint(run_dir / "checkpoints")
    model_c, _ = load_model_and_tokenizer(str(ckpt))
    weights = checkpointing.load_weights(ckpt)
    name = next(iter(weights))
    assert torch.equal(model_c.state_dict()[name], weights[name])
    mismatched = tmp_path / "short.de"
    mismatched.write_text("one line\n", encoding="utf-8")
    proc = subprocess.run(
        [
            sys.executable,
            str(TRANSLATE_SCRIPT),
            "--model",
            str(run_dir / "model"),
            "--input",
            str(src),
            "--output",
            str(tmp_path / "x"),
            "--references",
            str(mismatched),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    # one line, exit status 2, before the model loads
    assert proc.returncode == 2 and "short.de has 1" in proc.stderr and "Traceback" not in proc.stderr


# -------------------------------------------------------------------------------------------- every variant
def synthetic_parse(sentence: str) -> str:
    """A bracketed two-constituent parse whose leaves spell `sentence` (a stand-in for a real parser's output,
    enough to drive the syntactic MG-SA's phrase inputs and tag loss)."""
    words = [w.replace("(", "-LRB-").replace(")", "-RRB-") for w in sentence.split()]
    half = max(1, len(words) // 2)
    np_ = " ".join(f"(NN {w})" for w in words[:half])
    vp = " ".join(f"(VBZ {w})" for w in words[half:])
    return f"(ROOT (S (NP {np_}) (VP {vp})))" if vp else f"(ROOT (S (NP {np_})))"


@pytest.fixture(scope="module")
def parsed_data_dir(data_dir, tmp_path_factory):
    """The small data plus `<split>.en.parses.gz` (per-sentence source annotations) for MG-SA."""
    d = tmp_path_factory.mktemp("multi30k_parsed")
    for f in data_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    for split, n in (("train", 300), ("val", 30), ("test_2016_flickr", 30)):
        write_lines(d / f"{split}.en.parses.gz", [synthetic_parse(x) for x in head(data_dir / f"{split}.en.gz", n)])
    return d


@pytest.mark.parametrize("model_type", [t for t in ALL_TYPES if t != "transformer_nmt"])
def test_variant_tiny_run(model_type, data_dir, parsed_data_dir, tokenizer_dir, tmp_path):
    out = tmp_path / model_type
    extra = ["--model_type", model_type]
    if model_type == "mgsa_nmt":  # the tiny preset is the paper's syntactic MG-SA: it needs source parses
        data_dir = parsed_data_dir
        extra += ["--source_annotations", "parses"]
    results = train.main(tiny_args(data_dir, out, *extra, tokenizer=tokenizer_dir))
    losses = train_losses(out)
    assert losses[max(losses)] < losses[min(losses)] - 0.3, losses
    aux_keys = {k for r in read_log(out) for k in r if k.startswith("aux/")}
    if model_type in AUX_LOSS_TYPES:
        assert aux_keys, f"{model_type} should report its auxiliary loss"
        assert all(all(k in r for k in aux_keys) for r in read_log(out) if "loss" in r)
    else:
        assert not aux_keys
    assert results["model_type"] == model_type and results["steps"] == 24 and results["bleu"] is not None


def test_syntactic_mgsa_without_parses_stops_before_training(data_dir, tokenizer_dir, tmp_path):
    """The syntactic MG-SA on data without `--source_annotations parses` stops before its first step with a message
    naming the flag and the n-gram alternative (not a model error inside the first batch)."""
    with pytest.raises(DataError) as error:
        train.main(tiny_args(data_dir, tmp_path / "run", "--model_type", "mgsa_nmt", tokenizer=tokenizer_dir))
    assert "--source_annotations parses" in str(error.value) and "phrase_type='ngram'" in str(error.value)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    results = train.main(
        tiny_args(
            data_dir,
            tmp_path / "ngram",
            "--model_type",
            "mgsa_nmt",
            "--config_overrides",
            "phrase_type=ngram",
            tokenizer=tokenizer_dir,
        )
    )
    assert results["steps"] == 24


def test_marian_through_the_same_loop(data_dir, tokenizer_dir, tmp_path):
    """`--model_type marian`: transformers' MarianMTModel trained, checkpointed and evaluated by the same script,
    with the script's label smoothing (Marian's own loss has none)."""
    from transformers import MarianMTModel

    from hf_variants.training import external

    out = tmp_path / "marian"
    results = train.main(tiny_args(data_dir, out, "--model_type", "marian", tokenizer=tokenizer_dir))
    assert results["model_type"] == "marian" and results["steps"] == 24 and results["bleu"] is not None
    losses = train_losses(out)
    assert losses[max(losses)] < losses[min(losses)] - 0.3, losses
    assert not (out / "model" / "README.md").exists()  # no card template for a model from outside hf_variants
    model = MarianMTModel.from_pretrained(out / "model").eval()
    assert sum(p.numel() for p in model.parameters()) == results["params"]
    assert model.config.d_model == TransformerNmtConfig.from_preset("tiny").d_model
    tok = AutoTokenizer.from_pretrained(out / "model")
    batch = external.prepare_translation_inputs(model, tok, ["A dog runs."], text_target=["Ein Hund rennt."])
    with torch.no_grad():
        output = model(**batch)
    logp = output.logits.log_softmax(-1)[0]
    labels = batch["labels"][0]
    nll = -logp.gather(-1, labels[:, None]).squeeze(-1)
    expected = (0.9 * nll - 0.1 * logp.mean(-1)).mean()  # label smoothing 0.1 spread over the whole vocabulary
    assert torch.allclose(external.translation_loss(model, output, batch["labels"], 0.1), expected, atol=1e-5)
    assert torch.allclose(external.translation_loss(model, output, batch["labels"], 0.0), output.loss, atol=1e-5)


def test_multilingual_many_to_many(data_dir, tokenizer_dir, tmp_path):
    model_type = "mimo_nmt"
    out = tmp_path / "multi"
    results = train.main(
        tiny_args(
            data_dir,
            out,
            "--model_type",
            model_type,
            "--languages",
            "en",
            "de",
            "fr",
            "--directions",
            "en-de,en-fr,de-fr",
            "--max_train_pairs",
            "150",
            "--report_to",
            "tensorboard",
            tokenizer=tokenizer_dir,
            steps=12,
        )
    )
    assert results["directions"] == ["en-de", "en-fr", "de-fr"] and results["train_pairs"] == 450
    assert set(results["per_direction"]) == {"en-de", "en-fr", "de-fr"}
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["languages"] == ["en", "de", "fr"] and config["target_language_tags"] is True
    losses = train_losses(out)
    assert losses[max(losses)] < losses[min(losses)]
    # tracker logging through Accelerate (tensorboard): the same scalars as log.jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((out / "logs").glob("*/events.out.tfevents.*")).parent))
    events.Reload()
    assert {"loss", "lr", "tokens_per_sec", "valid_loss", "valid_bleu"} <= set(events.Tags()["scalars"])


def test_bidirectional_tied(data_dir, tokenizer_dir, tmp_path):
    out = tmp_path / "tied_bi"
    results = train.main(
        tiny_args(data_dir, out, "--model_type", "tied_nmt", "--bidirectional", tokenizer=tokenizer_dir, steps=12)
    )
    assert results["directions"] == ["en-de", "de-en"] and results["bidirectional"] is True
    assert set(results["per_direction"]) == {"en-de", "de-en"}
    # the direction embedding is the only direction signal: no <2xx> tags under "auto"
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["target_language_tags"] is False and config["direction_embedding"] is True
    losses = train_losses(out)
    assert losses[max(losses)] < losses[min(losses)]


# ------------------------------------------------------------------------------------------------- bad data
def test_bad_data(data_dir, tokenizer_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    en = head(data_dir / "train.en.gz", 100)
    de = head(data_dir / "train.de.gz", 100)
    write_lines(bad / "train.en.gz", en)
    write_lines(bad / "train.de.gz", de[:-1])  # one line short
    for split in ("val", "test_2016_flickr"):
        for lang in ("en", "de"):
            write_lines(bad / f"{split}.{lang}.gz", head(data_dir / f"{split}.{lang}.gz", 10))
    with pytest.raises(DataError, match=r"train\.en\.gz has 100 lines.*train\.de\.gz has 99 lines"):
        train.main(tiny_args(bad, tmp_path / "r1", tokenizer=tokenizer_dir, steps=2))
    with pytest.raises(DataError, match=r"No file for language 'xx'"):
        train.main(tiny_args(data_dir, tmp_path / "r2", "--target_lang", "xx", tokenizer=tokenizer_dir, steps=2))
    with pytest.raises(DataError, match=r"invalid language code 'Deutsch'"):
        train.main(tiny_args(data_dir, tmp_path / "r3", "--target_lang", "Deutsch", tokenizer=tokenizer_dir, steps=2))
    # empty sides: counted skips, reported in results.json and the log (or an error naming file and line)
    de[5], en[17], de[40] = "", "  ", ""
    write_lines(bad / "train.de.gz", de)
    write_lines(bad / "train.en.gz", en)
    with pytest.raises(DataError, match=r"train\.de\.gz:6: empty target"):  # the target file's line
        train.main(tiny_args(bad, tmp_path / "r4", "--on_bad_pairs", "error", tokenizer=tokenizer_dir, steps=2))
    results = train.main(tiny_args(bad, tmp_path / "r5", tokenizer=tokenizer_dir, steps=2))
    assert results["dropped_pairs"] == 3 and results["train_pairs"] == 97
    assert results["dropped_reasons"] == {"empty_source": 1, "empty_target": 2}
    assert results["dropped_examples"] == {
        "empty_source": [f"{bad / 'train.en.gz'}:18"],
        "empty_target": [f"{bad / 'train.de.gz'}:6", f"{bad / 'train.de.gz'}:41"],
    }
    log = (tmp_path / "r5" / "train.log").read_text()
    assert "dropped 3 pairs" in log and "train.de.gz:6" in log and "train.en.gz:18" in log


# ----------------------------------------------------------------------------------- resume after SIGKILL
def test_resume_after_sigkill_loses_nothing(data_dir, tokenizer_dir, tmp_path):
    """A run killed with SIGKILL (twice, at different points) and resumed with `latest` ends with exactly the
    weights, losses and results of an uninterrupted run (dropout on, so the RNG state must be restored too)."""
    common = [
        "--dropout",
        "0.1",
        "--save_steps",
        "4",
        "--eval_steps",
        "8",
        "--keep_checkpoints",
        "2",
        "--final_model",
        "last",
    ]
    out = tmp_path / "killed"

    def command(steps):
        return [sys.executable, str(TRAIN_SCRIPT)] + tiny_args(
            data_dir, out, *common, "--resume_from_checkpoint", "latest", tokenizer=tokenizer_dir, steps=steps
        )

    env = subprocess_env()
    for kill_after_step in (4, 8):  # 100,000 steps: the run cannot end before it is killed, however late that is
        proc = subprocess.Popen(command(100_000), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            done = [s for s, _ in checkpointing.list_checkpoints(out / "checkpoints")]
            if done and max(done) >= kill_after_step:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
        time.sleep(0.3)  # somewhere inside the next steps (where exactly does not matter)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        assert not (out / "results.json").exists()
    # the real length: 16 steps, or a few past the newest checkpoint where the kills came late (a busy machine)
    steps = max(16, checkpointing.list_checkpoints(out / "checkpoints")[-1][0] + 4)
    reference = train.main(tiny_args(data_dir, tmp_path / "ref", *common, tokenizer=tokenizer_dir, steps=steps))
    proc = subprocess.run(command(steps), capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads((out / "results.json").read_text())
    assert resumed["steps"] == reference["steps"] == steps
    assert resumed["bleu"] == pytest.approx(reference["bleu"])
    ref_w = load_file(str(tmp_path / "ref" / "model" / "model.safetensors"))
    got_w = load_file(str(out / "model" / "model.safetensors"))
    assert ref_w.keys() == got_w.keys()
    for name in ref_w:
        assert torch.allclose(ref_w[name], got_w[name], atol=1e-6), name
    ref_losses, got_losses = train_losses(tmp_path / "ref"), train_losses(out)
    assert ref_losses.keys() == got_losses.keys()
    for step in ref_losses:
        assert got_losses[step] == pytest.approx(ref_losses[step], rel=1e-5), step


# ---------------------------------------------------------------------------------------- two CPU processes
def test_two_processes_match_one_process_with_accumulation(data_dir, tokenizer_dir, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on CPU (gloo) runs the same global batches as one process
    with 2 accumulation steps: same optimizer steps, nearly the same losses."""
    one = train.main(
        tiny_args(
            data_dir,
            tmp_path / "one",
            "--gradient_accumulation_steps",
            "2",
            "--eval_bleu_pairs",
            "0",
            tokenizer=tokenizer_dir,
            steps=10,
        )
    )
    cmd = two_process_launch(
        *tiny_args(
            data_dir,
            tmp_path / "two",
            "--gradient_accumulation_steps",
            "1",
            "--eval_bleu_pairs",
            "0",
            tokenizer=tokenizer_dir,
            steps=10,
        )
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["num_processes"] == 2 and one["num_processes"] == 1
    assert two["steps"] == one["steps"] == 10
    assert two["hyperparameters"]["steps_per_epoch"] == one["hyperparameters"]["steps_per_epoch"]
    l1, l2 = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert l1.keys() == l2.keys()
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-3), (step, l1, l2)
    v1 = [r["valid_loss"] for r in read_log(tmp_path / "one") if "valid_loss" in r]
    v2 = [r["valid_loss"] for r in read_log(tmp_path / "two") if "valid_loss" in r]
    assert v2 == pytest.approx(v1, rel=1e-3)
    assert "MULTI_CPU" in (tmp_path / "two" / "train.log").read_text()
    # the epochs' batches were shared through files (corpus.SharedEpochs), removed when training ended
    assert not (tmp_path / "two" / "epoch_batches").exists()

    # resuming: the 2-process checkpoint holds each process's random states (JSON), and the resumed 2-process run
    # continues as the resumed 1-process run does; resuming it with another number of processes is refused
    assert {"rng_state_0.json", "rng_state_1.json"} <= {
        p.name for p in (tmp_path / "two" / "checkpoints" / "step_10").iterdir()
    }
    resume = ["--eval_bleu_pairs", "0", "--resume_from_checkpoint", "latest"]
    with pytest.raises(SettingsChangedError, match=r"--num_processes: 2 -> 1"):
        train.main(
            tiny_args(
                data_dir,
                tmp_path / "two",
                "--gradient_accumulation_steps",
                "2",
                *resume,
                tokenizer=tokenizer_dir,
                steps=12,
            )
        )
    train.main(
        tiny_args(
            data_dir,
            tmp_path / "one",
            "--gradient_accumulation_steps",
            "2",
            *resume,
            tokenizer=tokenizer_dir,
            steps=12,
        )
    )
    cmd = cmd[: cmd.index(str(TRAIN_SCRIPT)) + 1] + tiny_args(
        data_dir, tmp_path / "two", "--gradient_accumulation_steps", "1", *resume, tokenizer=tokenizer_dir, steps=12
    )
    cmd[cmd.index("--main_process_port") + 1] = str(free_port())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["steps"] == 12 and [c["setting"] for c in two["settings_changes"]] == ["max_steps"]
    l1, l2 = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert max(l1) == max(l2) == 12 and l2[12] == pytest.approx(l1[12], rel=1e-3)
