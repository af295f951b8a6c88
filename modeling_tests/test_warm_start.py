"""Warm start (`hf_variants.warm_start`): every variant from a pretrained baseline, on tiny models.

- what "as close to the pretrained function as the paper allows" means per variant (module docstring), tested:
  MUTE (`plain` and `seq`), HySAN `concat` and MIMO (with and without task attention, bilingual and multilingual
  bases) give the base's logits (atol 1e-5) in eval; HySAN `gated_sum` equals `sum` (both: W^o on the mean of the
  branches) and is exact with one branch per side; MG-SA's word heads are the base's and its output does not depend
  on the new phrase memory at step 0; Tied's decoder path (`tied_init="decoder"`) or encoder path (`"encoder"`) is
  the base's;
- every base tensor is used (Tied: the other stack's blocks excepted), every variant tensor is accounted for;
- mismatched dimensions, vocabulary, positions and backbone settings: a ValueError naming both values;
- save / load round trip (Auto classes after `import hf_variants`, and `trust_remote_code` in a fresh process without
  the package), tokenizer files and generation config carried over, the CLI;
- one fine-tuning step from the function's result changes the weights with a finite loss; train.py's
  `--model_name_or_path` builds a warm-started folder as saved, and the model card names the base model.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_without_package
from transformers import AutoModelForSeq2SeqLM, GenerationConfig

import hf_variants
from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration
from hf_variants.commands.warm_start import main
from hf_variants.convert.warm_start import warm_start

VOCAB = 60


def make_base(seed: int = 0, **overrides) -> TransformerNmtForConditionalGeneration:
    """A tiny random baseline (post-norm, sinusoidal: Marian's backbone unless overridden), in eval mode."""
    torch.manual_seed(seed)
    config = TransformerNmtConfig.from_preset("tiny", vocab_size=VOCAB, **overrides)
    return TransformerNmtForConditionalGeneration(config).eval()


def batch(lengths=(9, 6, 3), seed=1, target_length=5):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, VOCAB, (len(lengths), max(lengths)), generator=g)
    attention_mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    input_ids[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = 2  # </s> closes every source
    labels = torch.randint(4, VOCAB, (len(lengths), target_length), generator=g)
    return {
        "input_ids": input_ids.masked_fill(attention_mask == 0, 0),
        "attention_mask": attention_mask,
        "labels": labels,
    }


def logits(model, inputs, **extra):
    with torch.no_grad():
        return model(**inputs, **extra).logits


def max_diff(variant, base, inputs, **extra) -> float:
    return (logits(variant, inputs, **extra) - logits(base, inputs)).abs().max().item()


# --------------------------------------------------------------------------------------------------- exact starts
@pytest.mark.parametrize(
    "backbone",
    [{}, dict(normalize_before=True, max_relative_positions=3, relative_position_values=True)],
    ids=["post-norm", "pre-norm-rel"],
)
@pytest.mark.parametrize("merge", ["plain", "seq"])
def test_mute_starts_at_the_base(backbone, merge):
    """Units = copies of the pretrained layer, alpha = 1/I, uniform M: the base's logits, whatever the base's norm
    placement and positions (kept, not MUTE's pre-norm + relative defaults)."""
    base = make_base(**backbone)
    model, report = warm_start(base, "mute_nmt", {"merge": merge}, return_report=True)
    for name in ("normalize_before", "max_relative_positions", "position_embedding_type"):
        assert getattr(model.config, name) == getattr(base.config, name)
    assert model.config.num_units == 4 and model.config.merge == merge
    assert report.unused == []
    assert max_diff(model, base, batch()) < 1e-5
    qkv = "model.encoder.layers.1.self_attn.qkv_proj"
    assert torch.equal(model.state_dict()[f"{qkv}.units.3.weight"], base.state_dict()[f"{qkv}.weight"])


def test_mute_seq_with_abs_normal_shuffle_is_projected_and_exact():
    base = make_base()
    model = warm_start(base, "mute_nmt", "merge=seq,shuffle_init=abs_normal")
    shuffle = model.state_dict()["model.encoder.layers.0.shuffle"]
    assert not torch.allclose(shuffle, torch.full_like(shuffle, 0.25))  # a random M ...
    assert torch.allclose(shuffle.sum(0), torch.ones(4), atol=1e-6)  # ... whose columns sum to one
    assert max_diff(model, base, batch()) < 1e-5


def test_hysan_concat_is_exact_and_gated_sum_is_the_mean_of_the_branches():
    base = make_base(normalize_before=True)
    concat = warm_start(base, "hysan_nmt", {"fusion": "concat"})
    assert max_diff(concat, base, batch()) < 1e-5
    gated, report = warm_start(base, "hysan_nmt", return_report=True)  # the paper's e1: gated sum
    assert gated.config.fusion == "gated_sum" and gated.config.normalize_before
    assert report.unused == []
    plain_sum = warm_start(base, "hysan_nmt", {"fusion": "sum"})
    # gate sigmoid(0) = 1/2 with W^o x 2/nb == sum with W^o / nb: both W^o on the mean of the branches
    assert torch.allclose(logits(gated, batch()), logits(plain_sum, batch()), atol=1e-5)
    one_branch = warm_start(base, "hysan_nmt", {"encoder_branches": ["global"], "decoder_branches": ["forward"]})
    assert max_diff(one_branch, base, batch()) < 1e-5
    # the stated distance: not exact, and closer than copying W^o unscaled (the naive start)
    naive = warm_start(base, "hysan_nmt")
    with torch.no_grad():  # state-dict tensors share the parameters' storage
        for key, tensor in naive.state_dict().items():
            if key.endswith(".self_attn.out_proj.weight"):
                tensor.mul_(naive.config.num_branches("decoder" if ".decoder." in key else "encoder") / 2)
    distance = max_diff(gated, base, batch())
    assert 1e-4 < distance < max_diff(naive, base, batch())


@pytest.mark.parametrize(
    "overrides",
    [{}, {"task_attention": False}, {"mimo": False}, {"mimo_memory": "merge"}, {"mixing_init_std": 1.0}],
    ids=["mimo", "no-task-attention", "no-mimo", "merge-memory", "random-mixing"],
)
def test_mimo_bilingual_base_is_exact(overrides):
    base = make_base()
    model, report = warm_start(base, "mimo_nmt", overrides, return_report=True)
    assert model.config.num_tasks == 1 and report.unused == []
    assert max_diff(model, base, batch()) < 1e-5


def test_mimo_multilingual_base_is_exact_for_every_task():
    base = make_base(languages=["de", "fr"], target_language_tags=True)
    model = warm_start(base, "mimo_nmt", {"languages": ("de", "fr"), "d_model": 32})  # the base's values: accepted
    assert model.config.languages == ["de", "fr"] and model.config.target_language_tags
    assert model.state_dict()["model.decoder.output_mix.task_logits"].shape[0] == 2
    for task in (0, 1):
        assert max_diff(model, base, batch(), tgt_lang_ids=torch.full((3,), task)) < 1e-5


def test_mgsa_word_heads_from_the_base_and_phrase_memory_silent_at_step_0():
    base = make_base()
    model, report = warm_start(base, "mgsa_nmt", {"phrase_type": "ngram"}, return_report=True)
    config = model.config
    d, word = config.d_model, config.word_heads * (config.d_model // config.encoder_attention_heads)
    qkv = model.state_dict()["model.encoder.layers.0.self_attn.qkv_proj.weight"]
    base_qkv = base.state_dict()["model.encoder.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[:d], base_qkv[:d])  # queries of every head
    assert torch.equal(qkv[d:], torch.cat([base_qkv[d : d + word], base_qkv[2 * d : 2 * d + word]]))  # word K/V
    assert report.unused == [] and any("phrase_memory" in k for k in report.initialised)
    before = logits(model, batch())
    with torch.no_grad():  # the new phrase memory does not reach the output at step 0 (W^o columns zero)
        for key, tensor in model.state_dict().items():
            if ".phrase_memory." in key:
                tensor.normal_()
    assert torch.allclose(before, logits(model, batch()), atol=1e-6)
    copy = warm_start(base, "mgsa_nmt", {"phrase_type": "ngram"}, phrase_heads_output="copy")
    assert not torch.allclose(before, logits(copy, batch()), atol=1e-3)
    assert max_diff(warm_start(base, "mgsa_nmt", {"phrase_type": "ngram", "mgsa_layers": []}), base, batch()) < 1e-5


@pytest.mark.parametrize("tied_init", ["decoder", "encoder"])
def test_tied_keeps_one_pretrained_path(tied_init):
    base = make_base(normalize_before=True)
    model, report = warm_start(base, "tied_nmt", tied_init=tied_init, return_report=True)
    other = "encoder" if tied_init == "decoder" else "decoder"
    assert report.unused and all(k.startswith(f"model.{other}.") for k in report.unused)
    assert torch.count_nonzero(model.state_dict()["model.encoder.target_space_embedding.weight"]) == 0
    inputs = batch()
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        base_encoded = base.get_encoder()(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        same_encoder = torch.allclose(encoded.last_hidden_state, base_encoded.last_hidden_state, atol=1e-5)
        # the decoder path on the base's memory
        decoder_inputs = dict(
            decoder_input_ids=inputs["labels"], attention_mask=inputs["attention_mask"], encoder_outputs=base_encoded
        )
        same_decoder = torch.allclose(model(**decoder_inputs).logits, base(**decoder_inputs).logits, atol=1e-5)
    assert (same_decoder, same_encoder) == ((True, False) if tied_init == "decoder" else (False, True))


def test_a_marian_folder_is_converted_and_exact(tmp_path):
    """A saved MarianMTModel (opus-mt's format, here random with an output bias and swish) as the base."""
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(0)
    marian = MarianMTModel(
        MarianConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            pad_token_id=VOCAB - 1,
            eos_token_id=0,
            decoder_start_token_id=VOCAB - 1,
            activation_function="swish",
            dropout=0.0,
        )
    ).eval()
    with torch.no_grad():
        marian.final_logits_bias.normal_(0, 0.1)
    marian.save_pretrained(tmp_path / "marian")
    inputs = batch()
    inputs["input_ids"] = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, VOCAB - 1)
    for model_type, overrides in (("mute_nmt", "merge=seq"), ("mimo_nmt", None)):
        model = warm_start(tmp_path / "marian", model_type, overrides)
        assert model.config.output_bias and model.config.activation_function == "swish"
        assert model.config.warm_started_from == str(tmp_path / "marian")
        assert max_diff(model, marian, inputs) < 1e-5


def test_every_tensor_is_accounted_for():
    base = make_base()
    for model_type in ("mute_nmt", "hysan_nmt", "mgsa_nmt", "mimo_nmt", "tied_nmt"):  # MG-SA: syntactic
        overrides = {"phrase_type": "syntactic"} if model_type == "mgsa_nmt" else None  # (the default is n-grams)
        model, report = warm_start(base, model_type, overrides, return_report=True)
        keys = set(model.state_dict())
        assert set(report.copied) | set(report.derived) | set(report.initialised) == keys
        assert not set(report.copied) & set(report.initialised)
        # a tensor the base has under the same name is taken from the base, never initialised anew (a mapping that
        # missed a renamed or reshaped key would leave it to the variant's random initialisation)
        assert not set(report.initialised) & set(base.state_dict()), model_type
        assert report.copied, model_type


# ----------------------------------------------------------------------------------------------------- mismatches
@pytest.mark.parametrize(
    "model_type, overrides, message",
    [
        ("mute_nmt", {"d_model": 64}, r"`d_model=64` does not match the base model's `d_model=32`"),
        ("hysan_nmt", {"vocab_size": 80}, r"`vocab_size=80` does not match the base model's `vocab_size=60`"),
        ("mute_nmt", {"hidden_size": 64}, r"`d_model=64` does not match the base model's `d_model=32`"),
        (
            "mute_nmt",
            {"normalize_before": True},
            r"`normalize_before=True` does not match .* `normalize_before=False`",
        ),
        (
            "mute_nmt",
            {"max_relative_positions": 16},
            r"`max_relative_positions=16` does not match .* `max_relative_positions=0`",
        ),
        (
            "tied_nmt",
            {"position_embedding_type": "learned"},
            r"`position_embedding_type='learned'` does not match .* `position_embedding_type='sinusoidal'`",
        ),
        (
            "hysan_nmt",
            {"use_positional_embeddings": False},
            r"`use_positional_embeddings=False` does not match .* `position_embedding_type='sinusoidal'`",
        ),
        ("mimo_nmt", {"encoder_ffn_dim": 128}, r"`encoder_ffn_dim=128` does not match .* `encoder_ffn_dim=64`"),
        ("mgsa_nmt", {"languages": ["de"]}, r"`languages=\['de'\]` does not match .* `languages=\[\]`"),
        ("mute_nmt", {"merg": "plain"}, r"`merg` is not a field of MuteConfig. Did you mean `merge`"),
        ("transformer_nmt", {}, r"`model_type` must be one of"),
    ],
)
def test_mismatch_is_a_clear_error(model_type, overrides, message):
    with pytest.raises(ValueError, match=message):
        warm_start(make_base(), model_type, overrides)


def test_a_base_the_variant_cannot_have_is_a_clear_error(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"mimo_nmt with the base model's settings is not valid: `normalize_before` "
        r"must be False with task_attention=False",
    ):
        warm_start(make_base(normalize_before=True), "mimo_nmt", {"task_attention": False})
    with pytest.raises(ValueError, match=r"`max_relative_positions` must be 0"):
        warm_start(make_base(normalize_before=True, max_relative_positions=4), "mimo_nmt")
    with pytest.raises(ValueError, match=r"`decoder_layers` must be equal to encoder_layers=2"):
        warm_start(make_base(decoder_layers=1), "tied_nmt")
    variant = warm_start(make_base(), "mute_nmt")
    variant.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"holds a 'mute_nmt' model; the base of a warm start must be a "
        r"transformer_nmt model",
    ):
        warm_start(tmp_path, "hysan_nmt")


# ------------------------------------------------------------------------------------------------ save and load
TYPES = {
    "mute_nmt": "merge=plain",
    "hysan_nmt": "fusion=concat",
    "mgsa_nmt": "phrase_type=ngram",
    "mimo_nmt": None,
    "tied_nmt": None,
}


def test_save_load_round_trip_and_fresh_process(tokenizer, tmp_path):
    base = make_base(normalize_before=False)
    base.generation_config = GenerationConfig(
        num_beams=3,
        max_length=40,
        length_penalty=0.6,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    inputs = {k: v for k, v in batch().items() if k != "labels"}
    expected = {}
    for model_type, overrides in TYPES.items():
        out = tmp_path / model_type
        model = warm_start(base_dir, model_type, overrides, output_dir=out, base_model_id="org/base-model")
        reloaded = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
        assert type(reloaded) is hf_variants.MODEL_CLASSES[model_type][2]
        assert reloaded.config.warm_started_from == "org/base-model"
        assert reloaded.generation_config.num_beams == 3 and reloaded.generation_config.length_penalty == 0.6
        assert (out / "tokenizer.json").read_text() == (base_dir / "tokenizer.json").read_text()
        assert json.loads((out / "warm_start.json").read_text())["model_type"] == model_type
        expected[model_type] = logits(model, inputs, decoder_input_ids=inputs["input_ids"][:, :4])
        assert torch.allclose(
            logits(reloaded, inputs, decoder_input_ids=inputs["input_ids"][:, :4]), expected[model_type], atol=1e-6
        )
    torch.save(inputs, tmp_path / "inputs.pt")
    code = f"""
        import torch
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
        inputs = torch.load({str(tmp_path / "inputs.pt")!r})
        out = {{}}
        for model_type in {list(TYPES)!r}:
            d = {str(tmp_path)!r} + "/" + model_type
            model = AutoModelForSeq2SeqLM.from_pretrained(d, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            AutoTokenizer.from_pretrained(d)
            with torch.no_grad():
                out[model_type] = model(**inputs, decoder_input_ids=inputs["input_ids"][:, :4]).logits
        torch.save(out, {str(tmp_path / "fresh.pt")!r})
    """
    run_without_package(code)
    result = torch.load(tmp_path / "fresh.pt")
    assert set(result) == set(TYPES)
    for model_type, values in result.items():
        assert torch.allclose(values, expected[model_type], atol=1e-5), model_type


def test_command_line(tmp_path, capsys):
    base_dir = tmp_path / "base"
    base = make_base()
    base.save_pretrained(base_dir)
    main(
        [
            "--base",
            str(base_dir),
            "--model_type",
            "mute_nmt",
            "--config_overrides",
            "merge=plain",
            "--config_overrides",
            "num_units=2",
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    printed = capsys.readouterr().out
    assert "mute_nmt warm-started from" in printed and "no tokenizer files" in printed
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out").eval()
    assert (model.config.num_units, model.config.merge) == (2, "plain")
    assert max_diff(model, base, batch()) < 1e-5
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "--base",
                str(base_dir),
                "--model_type",
                "mute_nmt",
                "--config_overrides",
                "d_model=64",
                "--output_dir",
                str(tmp_path / "bad"),
            ]
        )
    assert exit_info.value.code == 2
    assert "`d_model=64` does not match the base model's `d_model=32`" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------------------------------- fine-tuning
@pytest.mark.parametrize("model_type", list(TYPES))
def test_one_fine_tuning_step(model_type):
    base = make_base(dropout=0.1)
    model = warm_start(base, model_type, TYPES[model_type]).train()
    assert model.config.dropout == 0.1  # the base's training settings come along
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = model(**batch()).loss
    assert torch.isfinite(loss)
    loss.backward()
    optimizer.step()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert "model.shared.weight" in changed and len(changed) > len(before) // 2


def test_train_py_loads_a_warm_started_model_and_the_card_names_the_base(tokenizer, tmp_path):
    """train.py --model_name_or_path OUT builds the warm-started model as saved (a 2-step run:
    `python training/train.py --model_name_or_path OUT --max_steps 2 ...`, in the report); the card of the run names
    the base model (the config's `warm_started_from`), a Hub id as its `base_model`."""
    from hf_variants.training import train
    from model_cards.card import build_model_card

    base = TransformerNmtForConditionalGeneration(
        TransformerNmtConfig.from_preset(
            "tiny",
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.bos_token_id,
        )
    )
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    warm = tmp_path / "warm"
    model = warm_start(tmp_path / "base", "hysan_nmt", output_dir=warm, base_model_id="org/opus-mt-en-de")
    args = train.parse_args(["--model_name_or_path", str(warm), "--config_overrides", "dropout=0.2"])
    loaded = train.build_model(args, tokenizer, ["en", "de"], False)
    assert type(loaded) is type(model) and loaded.config.dropout == 0.2
    assert loaded.config.warm_started_from == "org/opus-mt-en-de"
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    card = str(build_model_card(warm, {"base_model": str(warm)}))  # what train.py's results.json holds
    assert "base_model: org/opus-mt-en-de" in card
    assert "warm-started from [`org/opus-mt-en-de`](https://huggingface.co/org/opus-mt-en-de)" in card
    local = warm_start(tmp_path / "base", "mute_nmt", output_dir=tmp_path / "local")  # base recorded as its path
    card = str(build_model_card(tmp_path / "local", {"base_model": str(tmp_path / "local")}))
    assert "base_model:" not in card and "warm-started from the pretrained Transformer `base`" in card
    assert local.config.warm_started_from == str(tmp_path / "base")
