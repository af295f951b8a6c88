"""Input files as users make them: a UTF-8 byte-order mark (Windows Notepad) is no text in any reader, and the
tokenized-data cache key depends only on what decides the token ids (a relaunch with the run's `model/` folder as
--tokenizer reuses the cache)."""

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import read_sentences  # noqa: E402

from hf_variants.commands import inputs, progress, translate  # noqa: E402
from hf_variants.training import corpus, data_pipeline, train  # noqa: E402

BOM = "\ufeff"


def write(path: Path, lines, bom=True):
    text = (BOM if bom else "") + "".join(line + "\n" for line in lines)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def bom_data_dir(d: Path, n: int = 60) -> Path:
    """Multi30k en/de with a BOM at the start of every file (plain and .gz)."""
    d.mkdir(parents=True, exist_ok=True)
    for split, gz in (("train", False), ("val", True)):
        for lang in ("en", "de"):
            write(d / f"{split}.{lang}{'.gz' if gz else ''}", read_sentences(lang, split, n=n))
    return d


def tiny_run(data_dir, out, cache, *extra):
    train.main(
        [
            "--data_dir",
            str(data_dir),
            "--test_prefix",
            "",
            "--preset",
            "tiny",
            "--max_steps",
            "1",
            "--max_tokens",
            "512",
            "--warmup_steps",
            "1",
            "--eval_steps",
            "1",
            "--eval_bleu_pairs",
            "2",
            "--num_beams",
            "1",
            "--max_len_a",
            "0",
            "--max_len_b",
            "2",
            "--vocab_size",
            "300",
            "--num_examples",
            "0",
            "--output_dir",
            str(out),
            "--data_cache_dir",
            str(cache),
            *extra,
        ]
    )
    return Path(out)


@pytest.fixture(scope="module")
def tiny_model_dir(tokenizer, tmp_path_factory):
    import torch

    from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration

    torch.manual_seed(0)
    config = TransformerNmtConfig.from_preset("tiny", vocab_size=len(tokenizer), languages=["en", "de"])
    path = tmp_path_factory.mktemp("tiny_model")
    TransformerNmtForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------------ byte-order mark
def test_bom_is_dropped_by_every_reader(tmp_path):
    en, de = read_sentences("en", n=3), read_sentences("de", n=3)
    assert not en[0].startswith(BOM)
    files = {"en": write(tmp_path / "t.en", en), "de": write(tmp_path / "t.de.gz", de)}
    # the in-memory readers
    assert corpus.read_lines(files["en"]) == en and corpus.read_lines(files["de"]) == de
    with corpus.open_text(files["de"]) as f:
        assert f.readline().rstrip("\n") == de[0]
    assert corpus.load_text_files(files).rows[0] == {"en": en[0], "de": de[0]}
    tsv = write(tmp_path / "t.tsv", ["en\tde"] + [f"{a}\t{b}" for a, b in zip(en, de)])
    assert corpus.load_tsv(tsv).rows[0] == {"en": en[0], "de": de[0]}  # the header was "\ufeffen": a bad code
    jsonl = write(tmp_path / "t.jsonl.gz", [json.dumps({"translation": {"en": a, "de": b}}) for a, b in zip(en, de)])
    assert corpus.load_jsonl(jsonl).rows[0] == {"en": en[0], "de": de[0]}  # was "invalid JSON" at line 1
    # the streaming readers of the Arrow pipeline, from the start and after skipped lines
    assert [line for block in data_pipeline.iter_line_blocks(files["en"]) for line in block] == en
    assert [line for block in data_pipeline.iter_line_blocks(files["de"], skip=1) for line in block] == de[1:]
    for source in (data_pipeline.SplitSource.from_file(tsv), data_pipeline.SplitSource.from_file(jsonl)):
        rows = data_pipeline.load_rows(source, ["en", "de"], cache_dir=tmp_path / "cache")
        assert list(rows.texts("en")) == en and list(rows.texts("de")) == de
    # the tokenizer trainer's file reader
    from hf_variants.tokenization import read_lines

    assert list(read_lines(files["en"])) == en and list(read_lines(files["de"])) == de


def test_rows_cached_from_a_bom_file_are_not_reused(tmp_path):
    """Rows cached by a reader that kept the BOM have another key; a file without a BOM keeps its key."""
    plain = write(tmp_path / "p.en", ["a b"], bom=False)
    marked = write(tmp_path / "m.en", ["a b"])
    assert "utf8_bom" not in data_pipeline.file_identity(plain)
    assert data_pipeline.file_identity(marked)["utf8_bom"] == "dropped"
    assert data_pipeline.starts_with_bom(write(tmp_path / "m.en.gz", ["a b"]))


def test_training_on_bom_files_and_relaunch_with_the_model_folder_reuses_the_cache(tmp_path):
    """train.py on files saved with a BOM: the first pair and the trained tokenizer carry no U+FEFF. A relaunch
    with `--tokenizer RUN/model` (padding settings, model_max_length) finds every tokenized split in the cache."""
    data = bom_data_dir(tmp_path / "data")
    cache = tmp_path / "cache"
    run = tiny_run(data, tmp_path / "run", cache)
    rows = data_pipeline.load_rows(
        data_pipeline.SplitSource.from_dir(data, "train", ["en", "de"]), ["en", "de"], cache_dir=cache
    )
    assert next(rows.texts("en")) == read_sentences("en", n=1)[0]
    vocab = json.loads((run / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    assert not [piece for piece in vocab if BOM in piece]
    assert (run / "model" / "tokenizer.json").is_file()

    from transformers import AutoTokenizer

    copy = shutil.copytree(run / "tokenizer", tmp_path / "copy")
    keys = {
        name: data_pipeline.tokenizer_fingerprint(AutoTokenizer.from_pretrained(path))
        for name, path in (("tokenizer", run / "tokenizer"), ("model", run / "model"), ("copy", copy))
    }
    assert len(set(keys.values())) == 1, keys
    padded = AutoTokenizer.from_pretrained(copy)
    padded(["a b", "c"], padding=True, truncation=True, max_length=3)  # padding/truncation state of the backend
    padded.model_max_length = 7
    assert data_pipeline.tokenizer_fingerprint(padded) == keys["tokenizer"]
    from hf_variants.tokenization import train_tokenizer

    other = train_tokenizer(
        read_sentences("en", n=60) + read_sentences("de", n=60), vocab_size=200, languages=["en", "de"]
    )
    assert data_pipeline.tokenizer_fingerprint(other) != keys["tokenizer"]

    measured = sorted(p.name for p in cache.glob("measured-*"))
    assert measured
    tiny_run(data, tmp_path / "relaunch", cache, "--tokenizer", str(run / "model"))
    assert sorted(p.name for p in cache.glob("measured-*")) == measured  # nothing tokenized again


def test_translate_reads_bom_input(tmp_path, tiny_model_dir):
    """translate.py on a BOM'd text file, .gz file, JSONL file and stdin: read and translated as without the BOM."""
    model_dir = tiny_model_dir
    sentences = read_sentences("en", "val", n=2)
    gen = ["--num_beams", "1", "--max_len_a", "0", "--max_len_b", "3", "--no_progress"]
    translate.main(
        [
            "--model",
            str(model_dir),
            "--input",
            str(write(tmp_path / "plain.en", sentences, bom=False)),
            "--output",
            str(tmp_path / "expected"),
            *gen,
        ]
    )
    expected = (tmp_path / "expected").read_text(encoding="utf-8")
    for name in ("src.en", "src.en.gz", "src.jsonl"):
        lines = [json.dumps({"text": s}) for s in sentences] if name.endswith(".jsonl") else sentences
        path = str(write(tmp_path / name, lines))
        assert list(inputs.iter_lines(path)) == lines, name  # read lazily, the BOM dropped
        translate.main(["--model", str(model_dir), "--input", path, "--output", str(tmp_path / f"out.{name}"), *gen])
        assert (tmp_path / f"out.{name}").read_text(encoding="utf-8") == expected, name
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "training" / "translate.py"),
            "--model",
            str(model_dir),
            "--input",
            "-",
            "--output",
            "-",
            *gen,
        ],
        input=(BOM + "\n".join(sentences) + "\n").encode("utf-8"),
        capture_output=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.decode("utf-8") == expected


# ------------------------------------------------------------------------------------------ progress in log files
def test_translate_prints_progress_lines_when_stderr_is_a_pipe(tiny_model_dir, tmp_path, capsys):
    """stderr a pipe (nohup, SLURM, CI): no bar, but `progress:` lines with the right totals; 0 s: every batch."""
    src = write(tmp_path / "src.en", read_sentences("en", "val", n=5) + [""], bom=False)
    command = [
        sys.executable,
        str(ROOT / "training" / "translate.py"),
        "--model",
        str(tiny_model_dir),
        "--input",
        str(src),
        "--output",
        str(tmp_path / "out"),
        "--num_beams",
        "1",
        "--max_len_a",
        "0",
        "--max_len_b",
        "2",
        "--batch_size",
        "2",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        command + ["--progress_interval", "0"],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("progress: ")]
    # the empty line is done without the model, then the batches of two
    assert [line.split()[1] for line in lines] == ["1/6", "3/6", "5/6", "6/6"]
    assert lines[-1].startswith("progress: 6/6 sentences (100%), ") and lines[-1].endswith("ETA 0:00:00")
    assert all(" sentences/s, elapsed " in line for line in lines)
    assert "translating" not in proc.stderr and "\r" not in proc.stderr  # no bar
    translate.main(command[2:] + ["--progress_interval", "0", "--no_progress"])  # stderr: pytest's capture
    assert "progress: " not in capsys.readouterr().err
    translate.main(command[2:] + ["--progress_interval", "0"])
    assert "progress: 6/6 sentences (100%)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        translate.build_parser().parse_args(
            ["--model", "m", "--input", "i", "--output", "o", "--progress_interval", "-1"]
        )


def test_progress_lines_every_interval():
    """A line once `interval` seconds have passed since the last one, and a last line at the end."""
    import io

    now = [0.0]
    out = io.StringIO()
    bar = progress.ProgressLines(10, interval=5.0, stream=out, clock=lambda: now[0])
    for t, n in ((1, 2), (4, 2), (6, 2), (8, 2), (12, 2)):
        now[0] = t
        bar.update(n)
    lines = out.getvalue().splitlines()
    assert lines == [
        "progress: 6/10 sentences (60%), 1.0 sentences/s, elapsed 0:00:06, ETA 0:00:04",
        "progress: 10/10 sentences (100%), 0.8 sentences/s, elapsed 0:00:12, ETA 0:00:00",
    ]


# ------------------------------------------------------------------------------------ tokenizer/model mismatch
def test_tokenizer_larger_than_the_models_vocabulary_is_refused(tokenizer, tmp_path):
    """A tokenizer from another run: the pipeline and translate.py refuse it naming both sizes (it was an
    IndexError inside torch.nn.functional.embedding); a smaller tokenizer (a padded vocabulary) is fine."""
    import torch
    from transformers import pipeline

    from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration

    size = len(tokenizer)
    torch.manual_seed(0)
    small = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset("tiny", vocab_size=size - 8))
    small.save_pretrained(tmp_path / "small")
    tokenizer.save_pretrained(tmp_path / "small")
    message = (
        rf"has {size} tokens \(len\(tokenizer\)\) but the model( \(.*\))? has a vocabulary of {size - 8} "
        rf"\(config.vocab_size\)"
    )
    with pytest.raises(ValueError, match=message):
        pipeline("translation", model=small, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=message):
        pipeline("translation", model=str(tmp_path / "small"), trust_remote_code=True)
    src = write(tmp_path / "src.en", ["A man."], bom=False)
    with pytest.raises(ValueError, match=message):
        translate.main(["--model", str(tmp_path / "small"), "--input", str(src), "--output", str(tmp_path / "o")])
    padded = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset("tiny", vocab_size=size + 8))
    out = pipeline("translation", model=padded.eval(), tokenizer=tokenizer)("A man.", max_new_tokens=2)
    assert isinstance(out[0]["translation_text"], str)
