"""MIMO (task-aware multi-input-multi-output cardinality): the common checks, plus the paper's mechanisms.

The tiny configs use n=3 transformations (neither the head count nor the layer count, so a wrong axis shows up),
four target languages (Multi30k's en/de/fr/cs) and random task logits (`mixing_init_std`), so that the common
checks (cache, beams, padding, save/load) run with mixing weights that really differ per example.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from common import NmtModelTester, _allclose, assert_same_generation
from conftest import LANGUAGES, read_sentences

import hf_variants
from hf_variants import (
    MimoConfig,
    MimoForConditionalGeneration,
    TransformerNmtConfig,
    TransformerNmtForConditionalGeneration,
)
from hf_variants.compat_transformer_nmt import output_cache
from hf_variants.modeling_mimo import MimoEncoderOutput, MimoMix
from hf_variants.modeling_transformer_nmt import StackedLinear

N = 3


def tiny_config(**overrides) -> MimoConfig:
    settings = dict(
        num_transformations=N,
        languages=list(LANGUAGES),
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        mixing_init_std=0.5,
    )
    settings.update(overrides)
    return MimoConfig.from_preset("tiny", **settings)


def task_ids(batch_size: int) -> torch.Tensor:
    return torch.arange(batch_size) % len(LANGUAGES)


class TestMimo(NmtModelTester):
    model_type = "mimo_nmt"
    translation_kwargs = {"tgt_lang": "de"}

    def make_config(self, **overrides):
        return tiny_config(**overrides)

    def make_inputs(self, config, input_ids, attention_mask):
        return {"tgt_lang_ids": task_ids(input_ids.shape[0])}


# ------------------------------------------------------------------------------------------------------ helpers
def build(seed=0, vocab_size=64, **overrides) -> MimoForConditionalGeneration:
    torch.manual_seed(seed)
    return MimoForConditionalGeneration(tiny_config(vocab_size=vocab_size, **overrides)).eval()


def batch(config, batch_size=3, src_len=8, tgt_len=6, seed=1) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, config.vocab_size, (batch_size, src_len), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, src_len - 3 :] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, config.pad_token_id)
    labels = torch.randint(4, config.vocab_size, (batch_size, tgt_len), generator=g)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "tgt_lang_ids": task_ids(batch_size),
    }


def links(model) -> dict[str, MimoMix]:
    return {name: module for name, module in model.named_modules() if isinstance(module, MimoMix)}


def baseline_state(model: MimoForConditionalGeneration, unit: int) -> dict[str, torch.Tensor]:
    """Transformation `unit` of every MIMO block, renamed and reshaped into the baseline's state dict."""
    state = {}
    for name, tensor in model.state_dict().items():
        if "_mix." in name or name.startswith("model.decoder.output_mix") or "memory_merge" in name:
            continue  # mixing weights have no baseline counterpart
        # unit k's nn.Linear (`<name>.units.k.*`) -> the baseline's `<name>.*`; a stacked LayerNorm [n, d] -> row k
        match = re.fullmatch(r"(.*)\.units\.(\d+)\.(weight|bias)", name)
        if match:
            if int(match[2]) == unit:
                state[f"{match[1]}.{match[3]}"] = tensor.clone()
        elif "layer_norm." in name:
            state[name] = tensor[unit].clone()
        else:
            state[name] = tensor.clone()
    return state


def baseline_like(model: MimoForConditionalGeneration, layers: int | None = None):
    keys = set(TransformerNmtConfig().to_dict()) - {"model_type", "architectures", "auto_map", "transformers_version"}
    settings = {k: v for k, v in model.config.to_dict().items() if k in keys}
    if layers is not None:
        settings.update(encoder_layers=layers, decoder_layers=layers)
    settings["target_language_tags"] = False
    return TransformerNmtForConditionalGeneration(TransformerNmtConfig(**settings)).eval()


# ----------------------------------------------------------------------------------------- task-aware mixing
def test_mixing_weights_are_per_example():
    """Two examples with different target languages in one batch get different weights, each equal to what the
    example gets alone (the weights are gathered per row, not per batch)."""
    model = build()
    link = model.model.decoder.layers[1].ffn_mix
    probs = link.probabilities(torch.tensor([1, 2]))
    assert probs.shape == (2, N, N)
    assert _allclose(probs.sum(-1), torch.ones(2, N))
    assert _allclose(probs[0], torch.softmax(link.task_logits[1], -1)) and _allclose(
        probs[1], torch.softmax(link.task_logits[2], -1)
    )
    assert not torch.allclose(probs[0], probs[1])
    inputs = batch(model.config, batch_size=2)
    inputs["input_ids"][1] = inputs["input_ids"][0]
    inputs["attention_mask"][1] = inputs["attention_mask"][0]
    inputs["labels"][1] = inputs["labels"][0]
    inputs["tgt_lang_ids"] = torch.tensor([1, 2])
    with torch.no_grad():
        both = model(**inputs).logits
        alone = [model(**{k: v[i : i + 1] for k, v in inputs.items()}).logits[0] for i in range(2)]
    assert not torch.allclose(both[0], both[1], atol=1e-3)  # same sentence, different task -> different output
    assert _allclose(both[0], alone[0]) and _allclose(both[1], alone[1])


def test_zero_initialised_logits_give_uniform_mixing():
    model = build(mixing_init_std=0.0)
    assert links(model)
    for name, link in links(model).items():
        assert torch.equal(link.task_logits, torch.zeros_like(link.task_logits)), name
        probs = link.probabilities(torch.arange(len(LANGUAGES)))
        assert torch.equal(probs, torch.full_like(probs, 1.0 / N)), name
    # uniform mixing: the target language makes no difference at initialisation
    inputs = batch(model.config)
    with torch.no_grad():
        a = model(**inputs).logits
        b = model(**{**inputs, "tgt_lang_ids": torch.tensor([3, 3, 3])}).logits
    assert _allclose(a, b)


def test_task_ids_required_and_checked():
    model = build()
    inputs = batch(model.config)
    with pytest.raises(ValueError, match="tgt_lang_ids"):
        model(**{k: v for k, v in inputs.items() if k != "tgt_lang_ids"})
    with pytest.raises(ValueError, match=r"tgt_lang_ids.*\[0, 4\)"):
        model(**{**inputs, "tgt_lang_ids": torch.tensor([0, 1, 4])})
    single = build(languages=[], target_language_tags=False)  # one task: ids are optional
    assert single.config.num_tasks == 1
    with torch.no_grad():
        assert torch.isfinite(single(**{k: v for k, v in inputs.items() if k != "tgt_lang_ids"}).logits).all()


# -------------------------------------------------------------------------------------------- structure/shapes
def test_one_to_many_and_many_to_one_shapes():
    model = build()
    config = model.config
    enc, dec = model.model.encoder, model.model.decoder
    # one-to-many: the first self-attention block of each stack has no link before it; later ones do
    assert enc.layers[0].self_attn_mix is None and dec.layers[0].self_attn_mix is None
    assert all(layer.self_attn_mix is not None for layer in (*enc.layers[1:], *dec.layers[1:]))
    # MIMO links map n streams to n, the many-to-one maps n to 1
    assert all(
        link.task_logits.shape == (len(LANGUAGES), N, N)
        for name, link in links(model).items()
        if name != "model.decoder.output_mix"
    )
    assert dec.output_mix.task_logits.shape == (len(LANGUAGES), 1, N)
    inputs = batch(config)
    b, s, t, d = inputs["input_ids"].shape + (inputs["labels"].shape[1], config.d_model)
    encoder_out = enc(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        tgt_lang_ids=inputs["tgt_lang_ids"],
        output_hidden_states=True,
    )
    assert isinstance(encoder_out, MimoEncoderOutput)
    assert encoder_out.streams.shape == (b, N, s, d)  # no merge at the encoder top
    assert _allclose(encoder_out.last_hidden_state, encoder_out.streams.mean(1))
    # hidden states and attentions per layer: the mean over the n streams
    assert [h.shape for h in encoder_out.hidden_states] == [(b, s, d), (b, s, d), (b, s, d)]
    # the n streams differ (n distinct transformations), the unit outputs are post-norm (LayerNorm per unit)
    assert not torch.allclose(encoder_out.streams[:, 0], encoder_out.streams[:, 1], atol=1e-3)
    assert _allclose(encoder_out.streams.mean(-1), torch.zeros(b, N, s), atol=1e-5)
    out = model(**inputs, output_hidden_states=True, output_attentions=True)
    assert [h.shape for h in out.decoder_hidden_states] == [(b, t, d), (b, t, d), (b, t, d)]
    assert out.decoder_attentions[0].shape == (b, config.decoder_attention_heads, t, t)
    assert out.cross_attentions[0].shape == (b, config.decoder_attention_heads, t, s)
    streams = []
    enc.layers[0].register_forward_hook(lambda module, args, output: streams.append(output[0]))
    with torch.no_grad():
        again = enc(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            tgt_lang_ids=inputs["tgt_lang_ids"],
            output_hidden_states=True,
            output_attentions=True,
        )
    assert _allclose(again.hidden_states[1], streams[0].mean(0))
    # the classifier input is the task-weighted sum of the last FFN block's n outputs (many-to-one)
    captured = {}
    dec.layers[-1].register_forward_hook(lambda module, args, output: captured.update(streams=output[0]))
    with torch.no_grad():
        last = model.model(
            **{k: v for k, v in inputs.items() if k != "labels"},
            decoder_input_ids=model.prepare_decoder_input_ids_from_labels(inputs["labels"]),
        )
    weights = torch.softmax(dec.output_mix.task_logits[inputs["tgt_lang_ids"], 0], -1)  # [B, n]
    expected = torch.einsum("bm,mbtd->btd", weights, captured["streams"])
    assert captured["streams"].shape == (N, b, t, d)
    assert _allclose(last.last_hidden_state, expected)


def test_cache_holds_n_streams_per_layer_and_matches_uncached():
    model = build()
    config = model.config
    inputs = batch(config)
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(inputs["labels"])
    source = {k: v for k, v in inputs.items() if k != "labels"}
    with torch.no_grad():
        full = model(**source, decoder_input_ids=decoder_input_ids).logits
        encoder_outputs = model.get_encoder()(**source)
        first = model(
            **source, encoder_outputs=encoder_outputs, decoder_input_ids=decoder_input_ids[:, :3], use_cache=True
        )
        cache = output_cache(first)
        # one cache slot per decoder layer; the n units' keys/values side by side on the head axis
        heads, head_dim = config.decoder_attention_heads, config.d_model // config.decoder_attention_heads
        assert len(cache.self_attention_cache.layers) == config.decoder_layers
        b, s = inputs["input_ids"].shape
        assert cache.self_attention_cache.layers[0].keys.shape == (b, N * heads, 3, head_dim)
        assert cache.cross_attention_cache.layers[1].values.shape == (b, N * heads, s, head_dim)
        steps = [first.logits]
        for i in range(3, decoder_input_ids.shape[1]):
            step = model(
                **source,
                encoder_outputs=encoder_outputs,
                decoder_input_ids=decoder_input_ids[:, i : i + 1],
                cache=cache,
                use_cache=True,
            )
            steps.append(step.logits)
    assert _allclose(torch.cat(steps, 1), full, atol=1e-5)
    # a beam reorder moves every stream with its row
    keys = cache.self_attention_cache.layers[1].keys.clone()
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(cache.self_attention_cache.layers[1].keys, keys[[2, 0, 1]])


# ----------------------------------------------------------------------------------------------- ablations
def test_ablation_without_mimo_feeds_one_merged_input_to_every_block():
    model = build(mimo=False)
    for name, link in links(model).items():  # every link is a task-aware merge: n -> 1
        assert link.task_logits.shape == (len(LANGUAGES), 1, N), name
    inputs = batch(model.config)
    seen = []
    for layer in model.model.encoder.layers:
        layer.ffn.fc1.register_forward_hook(lambda module, args, output: seen.append(args[0]))
    with torch.no_grad():
        model(**inputs)
    assert len(seen) == model.config.encoder_layers and all(x.shape[0] == 1 for x in seen)
    # the mimo=True model with the same weights (its n->n links replaced by n copies of the merge row) is identical
    full = build(mimo=True)
    state = {}
    for name, tensor in model.state_dict().items():
        expand = "_mix." in name and "output_mix" not in name
        state[name] = tensor.expand(-1, N, -1).clone() if expand else tensor
    full.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert _allclose(full(**inputs).logits, model(**inputs).logits)
        full_default = build(mimo=True)(**inputs).logits
    assert not torch.allclose(full_default, model(**inputs).logits, atol=1e-3)


def test_ablation_without_task_attention_is_a_plain_sum():
    model = build(task_attention=False)
    assert all(link.task_logits is None for link in links(model).values())
    streams = torch.randn(N, 2, 5, model.config.d_model)
    assert _allclose(model.model.decoder.output_mix(streams, torch.tensor([0, 1]))[0], streams.sum(0))
    inputs = batch(model.config)
    with torch.no_grad():
        a = model(**inputs).logits
        b = model(**{**inputs, "tgt_lang_ids": torch.tensor([3, 2, 1])}).logits  # tasks play no role
        c = model(**{k: v for k, v in inputs.items() if k != "tgt_lang_ids"}).logits
    assert _allclose(a, b) and _allclose(a, c)
    # with plain sums every unit receives the same input: the mimo switch then changes nothing
    merged = build(task_attention=False, mimo=False)
    assert merged.state_dict().keys() == model.state_dict().keys()
    merged.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert _allclose(merged(**inputs).logits, a)
    # parameter difference between the full model and the ablation = exactly the task-attention tables
    full = build()
    n_links = sum(link.task_logits.numel() for link in links(full).values())
    assert full.num_parameters() - model.num_parameters() == n_links


def test_merge_memory_switch():
    model = build(mimo_memory="merge")
    assert all(layer.memory_mix is None for layer in model.model.decoder.layers)
    assert model.model.encoder.memory_merge.task_logits.shape == (len(LANGUAGES), 1, N)
    inputs = batch(model.config)
    source = {k: v for k, v in inputs.items() if k != "labels"}
    encoder_out = model.get_encoder()(**source)
    assert encoder_out.streams is None
    memory = model.model.encoder_memory(encoder_out)
    assert memory.shape == (3, inputs["input_ids"].shape[1], 1, model.config.d_model)  # [B, S, streams, d]
    weights = torch.softmax(model.model.encoder.memory_merge.task_logits[source["tgt_lang_ids"], 0], -1)
    streams = []
    model.model.encoder.layers[-1].register_forward_hook(lambda module, args, output: streams.append(output[0]))
    with torch.no_grad():
        again = model.get_encoder()(**source).last_hidden_state
    assert _allclose(again, torch.einsum("bm,mbtd->btd", weights, streams[0]))
    # every cross-attention unit reads the merged memory; decoding with and without cache (beams) agrees
    gen = dict(num_beams=3, max_new_tokens=6, min_new_tokens=6, output_scores=True, return_dict_in_generate=True)
    cached = model.generate(**source, use_cache=True, **gen)
    uncached = model.generate(**source, use_cache=False, **gen)
    assert_same_generation(cached, uncached)


# --------------------------------------------------------------------------------- equivalence with baseline
def test_single_transformation_equals_baseline():
    """n=1: every link is a softmax over one stream (= identity): the model is the post-norm baseline."""
    model = build(num_transformations=1)
    baseline = baseline_like(model)
    baseline.load_state_dict(baseline_state(model, 0), strict=True)
    inputs = batch(model.config)
    with torch.no_grad():
        expected = baseline(**{k: v for k, v in inputs.items() if k != "tgt_lang_ids"}).logits
        assert _allclose(model(**inputs).logits, expected, atol=1e-5)


def test_n_copies_of_the_baseline_equal_the_baseline():
    """The n units of every block hold the same weights -> all streams are equal, any convex mixing keeps them
    equal: the batched n-unit computation (stacked weights, heads side by side) must give the baseline's logits."""
    model = build()
    baseline = baseline_like(model)
    state = model.state_dict()
    copies = baseline_state(model, 0)
    for name in state:
        match = re.fullmatch(r"(.*)\.units\.\d+\.(weight|bias)", name)
        if match:  # every unit k gets unit 0's weights
            state[name] = copies[f"{match[1]}.{match[2]}"].clone()
        elif "layer_norm." in name and state[name].dim() == 2:
            state[name] = copies[name].unsqueeze(0).expand_as(state[name]).clone()
    model.load_state_dict(state)
    baseline.load_state_dict(baseline_state(model, 0), strict=True)
    inputs = batch(model.config)
    with torch.no_grad():
        expected = baseline(**{k: v for k, v in inputs.items() if k != "tgt_lang_ids"}).logits
        assert _allclose(model(**inputs).logits, expected, atol=1e-5)


def test_stacked_units_equal_separate_modules():
    """Each unit of a block is an independent transformation: unit k's output equals a baseline layer built from
    slice k of the stacked weights, applied to stream k."""
    model = build()
    layer = model.model.encoder.layers[1]
    baseline = baseline_like(model).model.encoder.layers[1]
    x = torch.randn(N, 2, 5, model.config.d_model)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., 3:] = False
    with torch.no_grad():
        attended, _, _ = layer.self_attn(x, attention_mask=mask)
        ffn = layer.ffn(x)
        for k in range(N):
            prefix = "model.encoder.layers.1."
            sliced = {
                name[len(prefix) :]: t for name, t in baseline_state(model, k).items() if name.startswith(prefix)
            }
            baseline.load_state_dict(sliced, strict=True)
            assert _allclose(attended[k], baseline.self_attn(x[k], attention_mask=mask)[0])
            assert _allclose(ffn[k], baseline.ffn(x[k]))
    linear = StackedLinear(N, 4, 6)
    for unit in linear.units:
        torch.nn.init.normal_(unit.weight)
        torch.nn.init.normal_(unit.bias)
    shared, per_unit = torch.randn(1, 3, 4), torch.randn(N, 3, 4)
    assert _allclose(linear(shared), torch.stack([unit(shared[0]) for unit in linear.units]))
    assert _allclose(linear(per_unit), torch.stack([unit(per_unit[k]) for k, unit in enumerate(linear.units)]))


def test_parameter_count_equals_deeper_baseline_plus_mixing():
    """L layers x n units has the parameters of an (L*n)-layer post-norm baseline, plus the task tables:
    T*n*n per MIMO link ((2L-1) encoder, (4L-1) decoder incl. per-layer memory links) and T*n many-to-one."""
    model = build()
    config = model.config
    layers, tasks = config.encoder_layers, config.num_tasks
    deep = baseline_like(model, layers=layers * N)
    mixing = tasks * N * N * ((2 * layers - 1) + (4 * layers - 1)) + tasks * N
    assert model.num_parameters() == deep.num_parameters() + mixing
    assert sum(link.task_logits.numel() for link in links(model).values()) == mixing


# ------------------------------------------------------------------------------------------------- init/config
def test_lipschitz_initialisation():
    torch.manual_seed(0)
    model = MimoForConditionalGeneration(
        tiny_config(vocab_size=64, mixing_init_std=0.0, decoder_ffn_dim=96, encoder_ffn_dim=96)
    )
    d = model.config.d_model
    fc2 = torch.stack([unit.weight for unit in model.model.decoder.layers[0].ffn.fc2.units])
    assert fc2.abs().max() <= 1 / math.sqrt(96) and fc2.abs().max() > 0.9 / math.sqrt(96)
    qkv = model.model.encoder.layers[1].self_attn.qkv_proj.units
    weights = torch.stack([unit.weight for unit in qkv])
    assert weights.abs().max() <= 1 / math.sqrt(d) and weights.abs().max() > 0.9 / math.sqrt(d)
    assert all(torch.equal(unit.bias, torch.zeros_like(unit.bias)) for unit in qkv)
    embeddings = model.model.shared.weight
    bound = math.sqrt(1 / 3) * math.sqrt(6 / (64 + d))
    assert model.lm_head.weight is embeddings
    assert embeddings.abs().max() <= bound and embeddings.abs().max() > 0.9 * bound
    assert torch.equal(embeddings[model.config.pad_token_id], torch.zeros(d))
    norm = model.model.decoder.layers[1].encoder_attn_layer_norm
    assert torch.equal(norm.weight, torch.ones_like(norm.weight)) and torch.equal(
        norm.bias, torch.zeros_like(norm.bias)
    )


def test_config_presets_and_validation():
    config = MimoConfig()
    assert (config.num_transformations, config.encoder_layers, config.d_model) == (4, 6, 512)
    assert config.mimo and config.task_attention and config.mimo_memory == "mix" and config.lipschitz_init
    assert not config.normalize_before and not config.target_language_tags
    assert MimoConfig(languages=["en", "de"]).target_language_tags
    assert MimoConfig.from_preset("base", languages=["en", "de"]).num_transformations == 4
    assert MimoConfig.from_preset("tiny").d_model == 32
    for field, value in [
        ("num_transformations", 0),
        ("mimo_memory", "concat"),
        ("mixing_init_std", -1.0),
        ("max_relative_positions", 4),
        ("task_attention", "yes"),
    ]:
        with pytest.raises(ValueError, match=field):
            MimoConfig(**{field: value})
    assert MimoConfig(normalize_before=True).normalize_before  # pre-norm units (a pre-norm base's warm start)
    with pytest.raises(ValueError, match="`normalize_before` must be False with task_attention=False"):
        MimoConfig(normalize_before=True, task_attention=False)  # plain sums of pre-norm streams would grow
    with pytest.raises(ValueError, match="Unknown language 'xx'"):
        MimoConfig(languages=["en", "de"]).language_id("xx")


# ----------------------------------------------------------------------------------------------- multilingual
def test_languages_in_generate_prepare_and_pipeline(tokenizer):
    model = build(vocab_size=len(tokenizer))
    sentences = read_sentences("en", "val", n=3)
    targets = ["de", "fr", "cs"]
    inputs = model.prepare_translation_inputs(tokenizer, sentences, src_lang="en", tgt_lang=targets)
    assert inputs["tgt_lang_ids"].tolist() == [1, 2, 3]
    tags = tokenizer.convert_tokens_to_ids(["<2de>", "<2fr>", "<2cs>"])
    assert inputs["input_ids"][:, 0].tolist() == tags  # the <2xx> target tag leads every source
    gen = dict(num_beams=2, max_new_tokens=6, min_new_tokens=6)
    by_ids = model.generate(**inputs, **gen)
    by_code = model.generate(
        input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], tgt_lang=targets, **gen
    )
    assert torch.equal(by_ids, by_code)
    one = model.prepare_translation_inputs(tokenizer, sentences[:1], tgt_lang="de")
    assert torch.equal(model.generate(**one, **gen)[0], by_ids[0, : by_ids.shape[1]])
    translator = hf_variants.TranslationPipeline(model=model, tokenizer=tokenizer, task="translation")
    texts = translator(sentences, src_lang="en", tgt_lang=targets, batch_size=2, **gen)
    assert [t["translation_text"] for t in texts] == tokenizer.decode(by_ids.tolist(), skip_special_tokens=True)
    with pytest.raises(ValueError, match="tgt_lang='xx' is an unknown language"):
        model.prepare_translation_inputs(tokenizer, sentences, tgt_lang="xx")
    with pytest.raises(ValueError, match="tgt_lang='xx' is an unknown language"):
        model.generate(input_ids=inputs["input_ids"], tgt_lang="xx", max_new_tokens=2)
    with pytest.raises(ValueError, match="needs `tgt_lang`"):
        model.prepare_translation_inputs(tokenizer, sentences)


@pytest.mark.parametrize("mimo_memory", ["mix", "merge"])
def test_encoder_and_decoder_standalone(mimo_memory, tmp_path):
    """Encoder and decoder saved and loaded on their own give the full model's states. The decoder reads the memory
    `MimoModel.encoder_memory` makes: the n encoder streams ("mix"), or with "merge" the encoder's last hidden
    state, exactly as a standard encoder-decoder. (The shared harness's Marian-style check feeds the decoder the
    last hidden state: for "mix" that equals the model only while the mixing weights are uniform, at init.)"""
    model = build(mimo_memory=mimo_memory).model.eval()
    inputs = batch(model.config)
    source = {k: inputs[k] for k in ("input_ids", "attention_mask", "tgt_lang_ids")}
    decoder_ids = inputs["labels"][:, :5]
    with torch.no_grad():
        full = model(**source, decoder_input_ids=decoder_ids)
    model.encoder.save_pretrained(tmp_path / "encoder")
    model.decoder.save_pretrained(tmp_path / "decoder")
    encoder = type(model.encoder).from_pretrained(tmp_path / "encoder").eval()
    decoder = type(model.decoder).from_pretrained(tmp_path / "decoder").eval()
    with torch.no_grad():
        encoded = encoder(**source)
        memory = model.encoder_memory(encoded)
        if mimo_memory == "merge":  # the standard interface: the encoder's last hidden state is the memory
            assert torch.equal(memory[:, :, 0], encoded.last_hidden_state)
            memory = encoded.last_hidden_state
        decoded = decoder(
            input_ids=decoder_ids,
            encoder_hidden_states=memory,
            encoder_attention_mask=source["attention_mask"],
            tgt_lang_ids=source["tgt_lang_ids"],
        )
    assert _allclose(encoded.last_hidden_state, full.encoder_last_hidden_state)
    assert _allclose(decoded.last_hidden_state, full.last_hidden_state)
