"""hf_variants: Transformer variants for NMT (MUTE, HySAN, MG-SA, MIMO, Tied) and their baseline, as transformers
models.

Importing the package registers every config and model with `AutoConfig`, `AutoModel` and `AutoModelForSeq2SeqLM`,
marks them for `save_pretrained` to write `auto_map` and copy the code (one-line `trust_remote_code` loading), and
restores the `translation` pipeline task (removed in transformers 5) for in-process use.
"""

import importlib
import importlib.util

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from .configuration_transformer_nmt import TransformerNmtConfig, language_tag
from .modeling_transformer_nmt import (
    TransformerNmtForConditionalGeneration,
    TransformerNmtModel,
    TransformerNmtPreTrainedModel,
)
from .pipeline_translation import TranslationPipeline

__version__ = "0.1.0"

# model_type -> (config class, base model class, generation model class).
MODEL_CLASSES = {
    "transformer_nmt": (TransformerNmtConfig, TransformerNmtModel, TransformerNmtForConditionalGeneration),
}
# The variants: model_type -> (configuration module, config class, modeling module, model, generation model).
_VARIANTS = {
    "mute_nmt": ("configuration_mute", "MuteConfig", "modeling_mute", "MuteModel", "MuteForConditionalGeneration"),
    "hysan_nmt": ("configuration_hysan", "HysanConfig", "modeling_hysan", "HysanModel",
                  "HysanForConditionalGeneration"),
    "mgsa_nmt": ("configuration_mgsa", "MgsaConfig", "modeling_mgsa", "MgsaModel", "MgsaForConditionalGeneration"),
    "mimo_nmt": ("configuration_mimo", "MimoConfig", "modeling_mimo", "MimoModel", "MimoForConditionalGeneration"),
    "tied_nmt": ("configuration_tied", "TiedTransformerConfig", "modeling_tied", "TiedTransformerModel",
                 "TiedTransformerForConditionalGeneration"),
}
for _model_type, (_config_module, _config_name, _modeling_module, _model_name, _generation_name) in _VARIANTS.items():
    if importlib.util.find_spec(f"{__name__}.{_modeling_module}") is None:  # TODO(dev): remove once all variants land
        continue
    _config_class = getattr(importlib.import_module(f".{_config_module}", __name__), _config_name)
    _modeling = importlib.import_module(f".{_modeling_module}", __name__)
    MODEL_CLASSES[_model_type] = (_config_class, getattr(_modeling, _model_name), getattr(_modeling, _generation_name))
    globals().update({_config_name: _config_class, _model_name: MODEL_CLASSES[_model_type][1],
                      _generation_name: MODEL_CLASSES[_model_type][2]})


def _register(config_class, model_class, generation_class) -> None:
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, model_class, exist_ok=True)
    AutoModelForSeq2SeqLM.register(config_class, generation_class, exist_ok=True)
    config_class.register_for_auto_class()
    model_class.register_for_auto_class("AutoModel")
    generation_class.register_for_auto_class("AutoModelForSeq2SeqLM")


def _restore_translation_task() -> None:
    """transformers 5 lists `translation` in its removed tasks, checked before the pipeline registry: remove that
    one entry and register our pipeline under the name, so that `pipeline("translation", model=obj,
    tokenizer=tok)` works after `import hf_variants`. Nothing else of the registry changes."""
    from transformers import pipelines

    pipelines.REMOVED_TASKS.pop("translation", None)
    pipelines.PIPELINE_REGISTRY.register_pipeline(
        "translation", pipeline_class=TranslationPipeline, pt_model=AutoModelForSeq2SeqLM, type="text"
    )


for _classes in MODEL_CLASSES.values():
    _register(*_classes)
_restore_translation_task()

CONFIG_CLASSES = {model_type: classes[0] for model_type, classes in MODEL_CLASSES.items()}

__all__ = [
    "CONFIG_CLASSES",
    "MODEL_CLASSES",
    "TransformerNmtConfig",
    "TransformerNmtModel",
    "TransformerNmtPreTrainedModel",
    "TransformerNmtForConditionalGeneration",
    "TranslationPipeline",
    "language_tag",
]
