"""The GPU-scale fast paths, checked on the CPU:
- static-cache decoding compiled as one graph (`cache_implementation="static"` + transformers' `CompileConfig`,
  fullgraph: what CUDA graphs need) gives the tokens and scores of the eager dynamic cache, greedy and beam 4, for
  every model type, with one compiled graph for all the steps (no recompilation per step);
- beam search reorders a static cache inside its own tensors (compiled steps read them at fixed addresses);
- the compiled training step (`hf_variants.training.fast_step`) gives the eager step's loss and gradients, with one
  graph for batches of different shapes;
- `benchmarks/gpu_scale.py` runs end to end on a tiny budget.

The compiled checks use dynamo with the "eager" / "aot_eager" backends: the same graph capture (and, for
"aot_eager", the same autograd graphs) as inductor, without its C++ code generation, which takes minutes on the CPU.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from common import assert_same_generation
from torch._dynamo.utils import counters
from transformers import CompileConfig
from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache

from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration
from hf_variants.compat_transformer_nmt import output_cache
from hf_variants.generation_transformer_nmt import compiled_decoding_steps
from hf_variants.training import fast_step

ROOT = Path(__file__).resolve().parent.parent

# (test module, tester class): the testers' tiny configs and variant inputs (parses, target languages)
TESTERS = {
    "transformer_nmt": ("test_modeling_transformer_nmt", "TestTransformerNmt"),
    "transformer_nmt_relative": ("test_modeling_transformer_nmt", "TestTransformerNmtPreNormRelative"),
    "mute_nmt": ("test_modeling_mute", "TestMute"),
    "hysan_nmt": ("test_modeling_hysan", "TestHysan"),
    "mgsa_nmt": ("test_modeling_mgsa", "TestMgsa"),
    "mimo_nmt": ("test_modeling_mimo", "TestMimo"),
    "tied_nmt": ("test_modeling_tied", "TestTiedTransformer"),
}


def make_tester(name: str):
    module, cls = TESTERS[name]
    return getattr(importlib.import_module(module), cls)()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def step_compile_config() -> CompileConfig:
    """One graph for the decoding step (fullgraph), captured by dynamo and run eagerly; on the CPU too."""
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize("name", sorted(TESTERS))
def test_compiled_static_decoding_equals_dynamic(name):
    t = make_tester(name)
    torch.manual_seed(0)
    # one decoder layer (a shared block for Tied): the compiled step's capture time grows with the layers
    layers = {"encoder_layers": 1, "decoder_layers": 1} if name == "tied_nmt" else {"decoder_layers": 1}
    model = t.model_class(t.make_config(vocab_size=80, **layers)).eval()
    inputs = t.batch(model.config, with_labels=False)
    for num_beams in (1, 4):
        kwargs = dict(
            num_beams=num_beams,
            max_new_tokens=8,
            min_new_tokens=8,
            length_penalty=0.6,
            output_scores=True,
            return_dict_in_generate=True,
        )
        dynamic = model.generate(**inputs, **kwargs)
        torch._dynamo.reset()
        before = graphs()
        fast = model.generate(**inputs, cache_implementation="static", compile_config=step_compile_config(), **kwargs)
        # one graph served the 7 steps after the first (greedy: transformers' compiled call; beam: ours)
        assert graphs() - before == 1, (name, num_beams)
        assert type(output_cache(fast).self_attention_cache) is StaticCache
        assert_same_generation(dynamic, fast)


def test_beam_reorder_of_a_static_cache_stays_in_place():
    """A static cache reordered by beam search keeps its tensors (the addresses a compiled step reads) and holds
    the rows a dynamic cache's reordering gives."""
    config = TransformerNmtConfig.from_preset("tiny", vocab_size=80)
    model = TransformerNmtForConditionalGeneration(config)
    g = torch.Generator().manual_seed(0)
    heads, dim = config.decoder_attention_heads, config.d_model // config.decoder_attention_heads
    keys = torch.randn(4, heads, 3, dim, generator=g)
    values = torch.randn(4, heads, 3, dim, generator=g)
    beam_idx = torch.tensor([1, 1, 3, 0])
    static = EncoderDecoderCache(StaticCache(config=config, max_cache_len=6), DynamicCache(config=config))
    dynamic = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
    for cache in (static, dynamic):
        cache.self_attention_cache.update(keys, values, 0)
    layer = static.self_attention_cache.layers[0]
    addresses = layer.keys.data_ptr(), layer.values.data_ptr()
    model._reorder_cache(static, beam_idx)
    model._reorder_cache(dynamic, beam_idx)
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == addresses
    expected = dynamic.self_attention_cache.layers[0]
    assert torch.equal(layer.keys[:, :, :3], expected.keys) and torch.equal(layer.values[:, :, :3], expected.values)
    assert torch.equal(expected.keys, keys[beam_idx])


def test_compiled_decoding_steps_keep_a_forward_installed_on_the_instance():
    """A forward wrapper on the instance (accelerate's device hooks) serves the eager calls inside the block and is
    back in place after it."""
    torch.manual_seed(0)
    model = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset("tiny", vocab_size=80)).eval()
    calls = []

    def hooked(*args, **kwargs):
        calls.append(kwargs["decoder_input_ids"].shape)
        return type(model).forward(model, *args, **kwargs)

    model.forward = hooked
    ids = torch.tensor([[5, 6, 7, 2]])
    with compiled_decoding_steps(model, step_compile_config()):
        assert model.forward is not hooked
        model(input_ids=ids, decoder_input_ids=ids[:, :2])  # no cache: not a decoding step, eager
    assert model.forward is hooked and calls == [torch.Size([1, 2])]


# ------------------------------------------------------------------------------------------------- training step
def training_batch(g, sentences: int, source: int, target: int) -> dict:
    input_ids = torch.randint(4, 80, (sentences, source), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -2:] = 0
    labels = torch.randint(4, 80, (sentences, target), generator=g)
    labels[-1, -3:] = -100
    return {
        "input_ids": input_ids.masked_fill(attention_mask == 0, 0),
        "attention_mask": attention_mask,
        "labels": labels,
    }


def step_gradients(model, batch) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch, skip_logits=True).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_training_step_equals_eager_with_one_graph_for_every_shape():
    """`compile_body` ("aot_eager": dynamo's graphs and AOTAutograd's forward/backward graphs, run without code
    generation): the eager step's loss and gradients on batches of three shapes, one compiled graph for all of
    them; evaluation and generation stay eager (no graph added)."""
    torch.manual_seed(0)
    config = TransformerNmtConfig.from_preset("tiny", vocab_size=80, decoder_layers=1, encoder_layers=1)
    model = TransformerNmtForConditionalGeneration(config).train()
    g = torch.Generator().manual_seed(0)
    batches = [training_batch(g, *shape) for shape in ((4, 9, 7), (6, 13, 11), (3, 17, 16))]
    eager = [step_gradients(model, batch) for batch in batches]
    torch._dynamo.reset()
    before = graphs()
    assert fast_step.compile_body(model, backend="aot_eager") is model.model
    for batch, (loss, grads) in zip(batches, eager):
        compiled_loss, compiled_grads = step_gradients(model, batch)
        assert torch.allclose(compiled_loss, loss, atol=1e-5, rtol=1e-5)
        assert compiled_grads.keys() == grads.keys() and len(grads) > 0
        for name in grads:
            assert torch.allclose(compiled_grads[name], grads[name], atol=1e-5, rtol=1e-4), name
    assert graphs() - before == 1
    model.eval()
    source = {k: v for k, v in batches[0].items() if k != "labels"}
    model.generate(**source, max_new_tokens=3)
    assert graphs() - before == 1


def test_adam_is_fused_on_cuda_with_the_same_update():
    """`fast_step.adam`: fused on CUDA (the fused kernel also runs on the CPU, where it is compared with the
    multi-tensor update the optimizer uses elsewhere), foreach otherwise; one step gives the same weights."""
    assert fast_step.fused_available("cuda") and not fast_step.fused_available("cpu")
    weights = []
    for device in ("cuda", "cpu"):
        torch.manual_seed(0)
        layer = torch.nn.Linear(6, 5)
        optimizer = fast_step.adam(layer.parameters(), device, lr=1e-2, weight_decay=0.01)
        assert bool(optimizer.defaults["fused"]) is (device == "cuda")
        assert bool(optimizer.defaults["foreach"]) is (device == "cpu")
        for _ in range(3):
            layer(torch.linspace(-1, 1, 12).view(2, 6)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        weights.append(layer.weight.detach())
    assert torch.allclose(weights[0], weights[1], atol=1e-6)


# ------------------------------------------------------------------------------------------------------- benchmark
@pytest.fixture(scope="module")
def gpu_scale():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield importlib.import_module("gpu_scale")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_gpu_scale_token_batches_cover_every_pair_within_the_budget(gpu_scale):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (500, 2), generator=g).tolist()
    pairs = [([5] * a, [6] * b) for a, b in lengths]
    batches = gpu_scale.token_batches(pairs, 256)
    assert sorted(i for batch in batches for i in batch) == list(range(500))
    for batch in batches:
        assert len(batch) * max(max(len(pairs[i][0]), len(pairs[i][1])) for i in batch) <= 256
    # length-bucketed: sorted by length, so a batch's sentences are about as long (here within 3 tokens)
    assert all(max(len(pairs[i][0]) for i in b) - min(len(pairs[i][0]) for i in b) <= 3 for b in batches)


def test_gpu_scale_runs_end_to_end_on_the_cpu(gpu_scale, tmp_path):
    """The CPU smoke run on a small grid (tiny baseline, "eager" backend): training eager and compiled, decoding
    greedy and beam 4 on both paths with the same tokens, the trimmed cells listed, FLOPs counted."""
    out = tmp_path / "gpu_scale.json"
    args = ["--device", "cpu", "--tiny", "--models", "baseline", "--token_batches", "256", "--decode_batches", "4"]
    record = gpu_scale.main(
        [*args, "--backend", "eager", "--max_pairs", "600", "--budget_s", "300", "--output", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert [(r["compiled"], r["token_batch"]) for r in record["train"]] == [(False, 256), (True, 256)]
    eager, compiled = record["train"]
    assert eager["flops_per_step"] == compiled["flops_per_step"] > 0
    assert compiled["graphs_compiled_warmup"] == 1 and compiled["recompilations_timed"] == 0
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_s"] <= r["padded_tokens_per_s"] for r in record["train"])
    assert [r["num_beams"] for r in record["decode"]] == [1, 4]
    for row in record["decode"]:
        assert row["same_tokens"] and row["static_compiled"]["graphs_compiled_warmup"] >= 1
        assert row["static_compiled"]["recompilations_timed"] == 0
    assert record["skipped"] == [] and record["metadata"]["versions"]["torch"] == torch.__version__
