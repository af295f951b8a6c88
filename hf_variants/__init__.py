"""hf_variants: Transformer variants for NMT (MUTE, HySAN, MG-SA, MIMO, Tied) and their baseline, as transformers
models.

Importing the package registers every config and model with `AutoConfig`, `AutoModel` and `AutoModelForSeq2SeqLM`,
marks them for `save_pretrained` to write `auto_map` and copy the code (one-line `trust_remote_code` loading), and
restores the `translation` pipeline task (removed in transformers 5) for in-process use.
"""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from .configuration_hysan import HysanConfig
from .configuration_mgsa import MgsaConfig
from .configuration_mimo import MimoConfig
from .configuration_mute import MuteConfig
from .configuration_tied import TiedTransformerConfig
from .configuration_transformer_nmt import TransformerNmtConfig, language_tag
from .modeling_hysan import HysanForConditionalGeneration, HysanModel
from .modeling_mgsa import MgsaForConditionalGeneration, MgsaModel
from .modeling_mimo import MimoForConditionalGeneration, MimoModel
from .modeling_mute import MuteForConditionalGeneration, MuteModel
from .modeling_tied import TiedTransformerForConditionalGeneration, TiedTransformerModel
from .modeling_transformer_nmt import (
    TransformerNmtForConditionalGeneration,
    TransformerNmtModel,
    TransformerNmtPreTrainedModel,
)
from .pipeline_translation import TranslationPipeline
from .quantization import Int8Linear, quantize_for_cpu

__version__ = "0.2.0"

# model_type -> (config class, base model class, generation model class).
MODEL_CLASSES = {
    "transformer_nmt": (TransformerNmtConfig, TransformerNmtModel, TransformerNmtForConditionalGeneration),
    "mute_nmt": (MuteConfig, MuteModel, MuteForConditionalGeneration),
    "hysan_nmt": (HysanConfig, HysanModel, HysanForConditionalGeneration),
    "mgsa_nmt": (MgsaConfig, MgsaModel, MgsaForConditionalGeneration),
    "mimo_nmt": (MimoConfig, MimoModel, MimoForConditionalGeneration),
    "tied_nmt": (TiedTransformerConfig, TiedTransformerModel, TiedTransformerForConditionalGeneration),
}


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
    "MuteConfig",
    "MuteModel",
    "MuteForConditionalGeneration",
    "HysanConfig",
    "HysanModel",
    "HysanForConditionalGeneration",
    "MgsaConfig",
    "MgsaModel",
    "MgsaForConditionalGeneration",
    "MimoConfig",
    "MimoModel",
    "MimoForConditionalGeneration",
    "TiedTransformerConfig",
    "TiedTransformerModel",
    "TiedTransformerForConditionalGeneration",
    "TranslationPipeline",
    "Int8Linear",
    "quantize_for_cpu",
    "language_tag",
]
