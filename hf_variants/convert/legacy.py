"""Convert a MUTE or MIMO checkpoint saved by hf_variants 0.1 (stacked per-unit weights) to today's layout.

hf_variants 0.1 stored the I units of a MUTE encoder layer and the n transformations of a MIMO block as stacked
tensors (`...self_attn.qkv_weight` [I, 3d, d] for MUTE, `...qkv_proj.weight` [n, d, 3d] for MIMO). Since 0.2 every
unit is an `nn.Linear` (`...qkv_proj.units.{k}.weight` [3d, d]) that PEFT, quantization and pruning tools can reach,
run by the backbone's `StackedLinear` as one batched matmul. The values are the same; only the names and, for MIMO,
the orientation change. The other model types kept their layout and load as they are.

    python -m hf_variants.convert_legacy --model OLD_DIR --output_dir NEW_DIR [--force]

writes the converted model (config, generation config, weights, today's code) and copies the tokenizer and any other
file of OLD_DIR. NEW_DIR is written atomically and is never the input (`hf_variants.outputs`): it may not be, hold or
lie inside OLD_DIR; `--force` replaces only a folder an earlier conversion wrote. Loading an unconverted folder
raises a ValueError that names this command.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..outputs import OUTPUT_MANIFEST, atomic_output_dir, check_not_an_input, check_output_dir

COMMAND = "convert_legacy"  # recorded in the output folder's manifest: what `--force` may replace

# MUTE 0.1: <layer>.self_attn.{qkv,out}_{weight,bias}, <layer>.ffn.{fc1,fc2}_{weight,bias}: [I, out, in] / [I, out]
MUTE_LEGACY = re.compile(r"^(?P<prefix>.*\.(?:self_attn|ffn))\.(?P<name>qkv|out|fc1|fc2)_(?P<kind>weight|bias)$")
MUTE_NAMES = {"qkv": "qkv_proj", "out": "out_proj", "fc1": "fc1", "fc2": "fc2"}
# MIMO 0.1: <block>.{qkv_proj,q_proj,kv_proj,out_proj,fc1,fc2}.{weight,bias}: [n, in, out] / [n, out]
MIMO_LEGACY = re.compile(
    r"^(?P<prefix>.*\.layers\.\d+\.[a-z_]+)\.(?P<name>qkv_proj|q_proj|kv_proj|out_proj|fc1|fc2)"
    r"\.(?P<kind>weight|bias)$"
)


def is_legacy_key(model_type: str, key: str, tensor: torch.Tensor | None = None) -> bool:
    """Whether `key` (with its tensor, when known) is a 0.1 stacked-unit tensor of `model_type`."""
    if model_type == "mute_nmt":
        return MUTE_LEGACY.match(key) is not None
    if model_type == "mimo_nmt":
        match = MIMO_LEGACY.match(key)
        return match is not None and (tensor is None or tensor.dim() == (3 if match["kind"] == "weight" else 2))
    return False


def convert_state_dict(model_type: str, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The 0.1 state dict of a MUTE or MIMO model in today's names: every stacked tensor split into its units
    (MIMO's [n, in, out] weights transposed to nn.Linear's [out, in]); every other tensor unchanged."""
    converted = {}
    for key, tensor in state_dict.items():
        if not is_legacy_key(model_type, key, tensor):
            converted[key] = tensor
            continue
        pattern = MUTE_LEGACY if model_type == "mute_nmt" else MIMO_LEGACY
        match = pattern.match(key)
        module = MUTE_NAMES[match["name"]] if model_type == "mute_nmt" else match["name"]
        for unit, value in enumerate(tensor.unbind(0)):
            if model_type == "mimo_nmt" and match["kind"] == "weight":
                value = value.t()
            converted[f"{match['prefix']}.{module}.units.{unit}.{match['kind']}"] = value.contiguous()
    return converted


def convert_checkpoint(model_dir: str | Path, output_dir: str | Path, *, force: bool = False):
    """Convert the saved model in `model_dir` (a 0.1 MUTE or MIMO folder) into `output_dir`; returns the model.
    `output_dir` may not be, hold or lie inside `model_dir`; it is written atomically, and a non-empty one is
    replaced only with `force` and only when a conversion wrote it."""
    from transformers import AutoConfig

    from ..model_classes import MODEL_CLASSES

    model_dir, output_dir = Path(model_dir), Path(output_dir)
    check_not_an_input(output_dir, {"--model": model_dir})
    check_output_dir(output_dir, command=COMMAND, force=force)
    config = AutoConfig.from_pretrained(model_dir)
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No model*.safetensors in {model_dir}.")
    state_dict = {}
    for file in files:
        state_dict.update(load_file(file))
    converted = convert_state_dict(config.model_type, state_dict)
    model_class = MODEL_CLASSES[config.model_type][2]
    model = model_class(config)
    missing, unexpected = model.load_state_dict(converted, strict=False)
    tied = set(model.all_tied_weights_keys)
    missing = [key for key in missing if key not in tied]
    if missing or unexpected:
        raise ValueError(
            f"{model_dir} does not convert to {model_class.__name__}: missing {missing[:5]}, "
            f"unexpected {list(unexpected)[:5]}."
        )
    model.tie_weights()
    for module in model.modules():  # MUTE: the stored M was projected when it was saved; keep it as it is
        if getattr(module, "shuffle", None) is not None and hasattr(module, "_projected_version"):
            module._projected_version = module.shuffle._version
    if (model_dir / "generation_config.json").exists():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    with atomic_output_dir(output_dir, command=COMMAND, force=force) as staging:
        for item in model_dir.iterdir():  # tokenizer, model card, ... (not the weights or code, written below)
            if (
                item.is_file()
                and not item.name.startswith("model")
                and item.suffix != ".py"
                and item.name not in ("config.json", OUTPUT_MANIFEST)
            ):
                shutil.copy2(item, staging / item.name)
        model.save_pretrained(staging)
    return model
