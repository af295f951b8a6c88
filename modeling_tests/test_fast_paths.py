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
from pathlib import Path

import pytest
import torch
import torch._dynamo
from common import assert_same_generation
from torch._dynamo.utils import counters
from transformers import CompileConfig
from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache

from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration

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
        assert type(fast.past_key_values.self_attention_cache) is StaticCache
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
