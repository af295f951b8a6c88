"""The moving average of the weights (`--ema_decay`, hf_variants/training/ema.py): the update is the formula, the
swap for validation restores the weights bit for bit, the average never changes what is trained, it is saved in
every checkpoint and a resumed run's average is bit-identical to an uninterrupted one's, on one process and on two
(DDP over gloo); validation and the final model use it (`--eval_weights`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import (  # noqa: E402,F401 (fixtures)
    data_dir,
    read_log,
    subprocess_env,
    tiny_args,
    tokenizer_dir,
    two_process_launch,
)

from hf_variants.training import checkpointing, ema, train  # noqa: E402

COMMON = [
    "--dropout",
    "0.1",
    "--save_steps",
    "4",
    "--eval_steps",
    "4",
    "--eval_bleu_pairs",
    "0",
    "--keep_checkpoints",
    "0",
    "--final_model",
    "last",
    "--max_valid_pairs",
    "16",
    "--max_test_pairs",
    "4",
    "--max_train_pairs",
    "160",
]
EMA = ["--ema_decay", "0.8", "--ema_start_step", "2"]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_update_swap_and_saved_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model[1].register_buffer("counter", torch.tensor([7.0]))
    average = ema.ExponentialMovingAverage(model, decay=0.75, start_step=1)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(1, 5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        average.update(step)
        for n, p in model.named_parameters():  # up to start_step a copy, then 0.75 * ema + 0.25 * weights
            expected[n] = p.detach().clone() if step <= 1 else torch.lerp(expected[n], p.detach(), 0.25)
    assert same(average.state_dict(), expected)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with average.swapped_in():
        assert same({n: p.detach() for n, p in model.named_parameters()}, expected)
    assert same({n: p.detach() for n, p in model.named_parameters()}, weights)  # bit for bit back
    assert same(average.state_dict(), expected)
    saved = average.checkpoint_weights()  # the average and the buffers, loadable as the model's weights
    assert torch.equal(saved["1.counter"], torch.tensor([7.0]))
    clone = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    clone[1].register_buffer("counter", torch.tensor([0.0]))
    checkpointing.load_model_weights(clone, saved)
    assert same(dict(clone.state_dict()), {**expected, "1.counter": torch.tensor([7.0])})
    with pytest.raises(ValueError, match="decay must be in"):
        ema.ExponentialMovingAverage(model, decay=1.0)


@pytest.fixture(scope="module")
def runs(data_dir, tokenizer_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("ema")

    def run(name, *extra, steps=8):
        return train.main(tiny_args(data_dir, base / name, *COMMON, *extra, tokenizer=tokenizer_dir, steps=steps))

    plain = run("plain")
    swaps = []  # the average is swapped in for each validation, and only then
    original = ema.ExponentialMovingAverage.swapped_in
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ema.ExponentialMovingAverage, "swapped_in", lambda self: swaps.append(1) or original(self))
        averaged = run("ema", *EMA)
    averaged["swaps"] = len(swaps)
    run("resumed", *EMA, steps=4)
    run("resumed", *EMA, "--resume_from_checkpoint", "latest")
    return base, plain, averaged


def test_average_leaves_training_alone_and_is_used(runs):
    base, plain, averaged = runs
    for step in (4, 8):  # the trained weights are those of a run without the average
        raw = [checkpointing.load_weights(base / name / "checkpoints" / f"step_{step}") for name in ("plain", "ema")]
        assert same(*raw)
    assert [r["loss"] for r in read_log(base / "plain") if "loss" in r] == [
        r["loss"] for r in read_log(base / "ema") if "loss" in r
    ]
    average = load_file(str(base / "ema" / "checkpoints" / "step_8" / ema.EMA_WEIGHTS))
    assert not same(average, {k: v for k, v in raw[1].items() if k in average})
    assert averaged["final_model"] == "EMA weights of last step 8"
    final = load_file(str(base / "ema" / "model" / "model.safetensors"))
    assert same({k: final[k] for k in average if k in final}, {k: average[k] for k in average if k in final})
    # validation used the average (--eval_weights ema, the default with --ema_decay)
    assert [r["valid_loss"] for r in averaged["validation"]] != [r["valid_loss"] for r in plain["validation"]]
    assert averaged["hyperparameters"]["eval_weights"] == "ema"
    assert averaged["swaps"] == len(averaged["validation"]) == 2
    assert "| `ema_decay` | 0.8 |" in (base / "ema" / "model" / "README.md").read_text()


def test_resumed_average_is_bit_identical(runs):
    base, _, _ = runs
    for name in (ema.EMA_WEIGHTS, "model.safetensors"):
        assert same(*(load_file(str(base / run / "checkpoints" / "step_8" / name)) for run in ("ema", "resumed")))
    assert same(*(load_file(str(base / run / "model" / "model.safetensors")) for run in ("ema", "resumed")))


def test_two_processes_equal_themselves_across_a_resume(data_dir, tokenizer_dir, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (gloo): each process keeps the average of the same
    weights; a 2-process run resumed from its step-4 checkpoint (into a new folder) ends with the uninterrupted
    run's average and weights at step 8, bit for bit."""

    def launch(out, *extra):
        cmd = two_process_launch(*tiny_args(data_dir, out, *COMMON, *EMA, *extra, tokenizer=tokenizer_dir, steps=8))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=subprocess_env())
        assert proc.returncode == 0, proc.stderr[-4000:]

    launch(tmp_path / "ref")
    launch(tmp_path / "resumed", "--resume_from_checkpoint", str(tmp_path / "ref" / "checkpoints" / "step_4"))
    results = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert results["num_processes"] == 2 and results["steps"] == 8
    for name in (ema.EMA_WEIGHTS, "model.safetensors"):
        ref, got = (load_file(str(tmp_path / run / "checkpoints" / "step_8" / name)) for run in ("ref", "resumed"))
        assert same(ref, got), name


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ema_decay", "1"], "--ema_decay must be in (0, 1)"),
        (["--ema_decay", "0"], "--ema_decay must be in (0, 1)"),
        (["--ema_start_step", "5"], "--ema_start_step needs --ema_decay"),
        (["--ema_decay", "0.9", "--ema_start_step", "-1"], "--ema_start_step must be >= 0"),
        (["--eval_weights", "ema"], "--eval_weights ema needs --ema_decay"),
    ],
)
def test_flags_are_checked_when_parsed(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--output_dir", "x", *extra])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_fsdp_is_refused_when_parsed(monkeypatch, capsys):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(SystemExit):
        train.parse_args(["--output_dir", "x", "--ema_decay", "0.99"])
    assert "--ema_decay is not supported under FSDP" in capsys.readouterr().err


# ------------------------------------------------------------------------- a checkpoint's weights, the run's identity
@pytest.fixture(scope="module")
def texts(data_dir, tmp_path_factory):
    """8 validation pairs (en, de) as line files."""
    from test_training import head

    folder = tmp_path_factory.mktemp("texts")
    for lang in ("en", "de"):
        (folder / f"in.{lang}").write_text("".join(line + "\n" for line in head(data_dir / f"val.{lang}.gz", 8)))
    return folder


def run_translate(model, texts, out, *extra) -> tuple[str, dict]:
    from hf_variants.commands import translate

    argv = ["--model", str(model), "--input", str(texts / "in.en"), "--output", str(out), *extra]
    result = translate.main([*argv, "--results_json", f"{out}.json", "--no_progress"])
    assert json.loads(Path(f"{out}.json").read_text()) == result  # the results JSON is the printed summary
    return Path(out).read_text(), result


def run_score(model, texts, out, *extra) -> tuple[list[float], dict]:
    from hf_variants.commands import score

    argv = ["--model", str(model), "--source", str(texts / "in.en"), "--target", str(texts / "in.de")]
    result = score.main([*argv, "--output", str(out), "--results_json", f"{out}.json", "--no_progress", *extra])
    assert json.loads(Path(f"{out}.json").read_text()) == result
    return [json.loads(line)["log_prob"] for line in Path(out).read_text().splitlines()], result


def test_a_checkpoint_of_an_ema_run_decodes_with_the_weights_its_run_validated(runs, texts, tmp_path):
    """`--model RUN/checkpoints/step_8` of a run whose model/ is step 8's moving average (--final_model last,
    --eval_weights ema) translates and scores exactly as `RUN/model`; `--weights raw` takes the trained weights
    (other scores); the summary and the results JSON name the weights used."""
    base, _, _ = runs
    run, checkpoint = base / "ema", base / "ema" / "checkpoints" / "step_8"
    published, result = run_translate(run / "model", texts, tmp_path / "model.de")
    assert "weights" not in result  # a model folder holds one set of weights
    default, result = run_translate(checkpoint, texts, tmp_path / "ckpt.de")
    assert default == published and result["weights"] == "ema" and result["model"] == str(checkpoint)
    assert run_translate(checkpoint, texts, tmp_path / "ema.de", "--weights", "ema")[0] == published
    _, result = run_translate(checkpoint, texts, tmp_path / "raw.de", "--weights", "raw")
    assert result["weights"] == "raw"
    model_scores, result = run_score(run / "model", texts, tmp_path / "model.jsonl")
    assert "weights" not in result
    ema_scores, result = run_score(checkpoint, texts, tmp_path / "ckpt.jsonl")
    assert ema_scores == model_scores and result["weights"] == "ema"
    raw_scores, result = run_score(checkpoint, texts, tmp_path / "raw.jsonl", "--weights", "raw")
    assert result["weights"] == "raw" and raw_scores != ema_scores
    # the raw weights are the checkpoint's model.safetensors: the plain run (same training, no average) scores so
    assert raw_scores == run_score(base / "plain" / "checkpoints" / "step_8", texts, tmp_path / "plain.jsonl")[0]


def server_health(*argv) -> dict:
    """`GET /health` of an in-process server of `hf-variants-serve ARGV` once it is ready."""
    import time
    from functools import partial

    pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hf-variants[serve]'")
    from fastapi.testclient import TestClient

    from hf_variants.commands import serve
    from hf_variants.serve.app import create_app

    args = serve.build_parser().parse_args([*argv, "--num_threads", "1", "--allowed_hosts", "testserver"])
    location, settings = serve.settings_from_args(args)
    with TestClient(create_app(settings, loader=partial(serve.server_translator, location))) as client:
        deadline = time.monotonic() + 300
        while (answer := client.get("/health")).status_code == 503:
            assert time.monotonic() < deadline, answer.json()
            time.sleep(0.05)
        return answer.json()


def test_the_server_names_a_checkpoints_weights(runs):
    base, _, _ = runs
    checkpoint = base / "ema" / "checkpoints" / "step_8"
    assert server_health("--model", str(checkpoint))["weights"] == "ema"
    assert server_health("--model", str(checkpoint), "--weights", "raw")["weights"] == "raw"
    assert "weights" not in server_health("--model", str(base / "ema" / "model"))


def test_average_takes_the_validated_weights_by_default(runs, tmp_path, capsys):
    from hf_variants.commands import average

    base, _, _ = runs
    run = base / "ema"
    out = average.main([str(run), "--checkpoints", "step_8", "--output_dir", str(tmp_path / "default")])
    assert "Averaged the moving averages of 1 checkpoint(s)" in capsys.readouterr().out
    assert same(load_file(str(out / "model.safetensors")), load_file(str(run / "model" / "model.safetensors")))
    assert "average of EMA weights of step_8" in (out / "README.md").read_text()
    raw = average.main([str(run), "--checkpoints", "step_8", "--weights", "raw", "--output_dir", str(tmp_path / "r")])
    assert "Averaged the weights of 1 checkpoint(s)" in capsys.readouterr().out
    assert same(load_file(str(raw / "model.safetensors")), checkpointing.load_weights(run / "checkpoints" / "step_8"))


def run_ids(run: Path) -> dict[int, str]:
    return {
        s: json.loads((p / checkpointing.MARKER).read_text())["run_id"]
        for s, p in checkpointing.list_checkpoints(run / "checkpoints")
    }


def test_every_checkpoint_records_its_run_and_a_resume_keeps_it(runs):
    base, plain, averaged = runs
    ids = {name: run_ids(base / name) for name in ("plain", "ema", "resumed")}
    assert all(set(steps) == {4, 8} and len(set(steps.values())) == 1 for steps in ids.values())  # one id a run
    assert ids["ema"][8] == averaged["run_id"] and ids["plain"][8] == plain["run_id"] != averaged["run_id"]
    resumed = json.loads((base / "resumed" / "results.json").read_text())
    assert resumed["run_id"] == ids["resumed"][4] == ids["resumed"][8] != averaged["run_id"]  # kept on resume
    assert f"| Run id | `{averaged['run_id']}` |" in (base / "ema" / "model" / "README.md").read_text()


def test_averaging_checkpoints_of_two_runs_is_refused_naming_both(runs, tmp_path, capsys):
    """Same config and tokenizer, another run: refused (exit 2) naming both checkpoints and both run ids;
    `--allow_other_runs` averages them and the card says so; a checkpoint written before run ids belongs to the run
    of its folder."""
    import shutil

    from hf_variants.commands import average
    from hf_variants.training import averaging

    base, plain, averaged = runs
    ema_ckpt, plain_ckpt = base / "ema" / "checkpoints" / "step_8", base / "plain" / "checkpoints" / "step_8"
    both = [str(base / "ema"), "--checkpoints", str(ema_ckpt), str(plain_ckpt), "--weights", "raw"]
    with pytest.raises(SystemExit) as exit_:
        average.main([*both, "--output_dir", str(tmp_path / "refused")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert f"{ema_ckpt} and {plain_ckpt} are checkpoints of different runs" in err
    assert f"(run {averaged['run_id']} and run {plain['run_id']})" in err and not (tmp_path / "refused").exists()
    out = average.main([*both, "--allow_other_runs", "--output_dir", str(tmp_path / "mixed")])
    said = capsys.readouterr().out
    assert f"of 2 runs ({averaged['run_id']}, {plain['run_id']})" in said
    card = (out / "README.md").read_text()
    assert f"checkpoints of 2 runs: {averaged['run_id']}, {plain['run_id']}, averaged with --allow_other_runs" in card
    assert "| Run id |" not in card
    # a checkpoint without a run id (written before them): the run of its folder
    old = tmp_path / "old"
    shutil.copytree(base / "ema", old)
    marker = old / "checkpoints" / "step_4" / checkpointing.MARKER
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "run_id"}))
    average.main([str(old), "--last", "2", "--output_dir", str(tmp_path / "old_avg")])
    assert f"{old / 'checkpoints' / 'step_4'} was written before run ids" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        average.main([str(old), "--checkpoints", "step_4", str(plain_ckpt), "--output_dir", str(tmp_path / "x")])
    assert f"(the run in {old.resolve()} (no run id: written before run ids) and run {plain['run_id']})" in (
        capsys.readouterr().err
    )
    # --average_last averages the run's own checkpoints: one of another run put in its folder is left out
    shutil.copytree(plain_ckpt, old / "checkpoints" / "step_9")
    own = averaging.own_checkpoints(old / "checkpoints", averaged["run_id"])
    assert [p.name for p in own] == ["step_4", "step_8"]
