"""hf_variants: Transformer variants for NMT (MUTE, HySAN, MG-SA, MIMO, Tied) and their baseline, as transformers
models.

Importing the package registers every config and model with `AutoConfig`, `AutoModel` and `AutoModelForSeq2SeqLM`,
marks them for `save_pretrained` to write `auto_map` and copy the code (one-line `trust_remote_code` loading), and
restores the `translation` pipeline task (removed in transformers 5) for in-process use.
"""

from .configuration_hysan import HysanConfig
from .configuration_mgsa import MgsaConfig
from .configuration_mimo import MimoConfig
from .configuration_mute import MuteConfig
from .configuration_tied import TiedTransformerConfig
from .configuration_transformer_nmt import TransformerNmtConfig, language_tag
from .deploy.int8 import Int8Linear, quantize_for_cpu
from .model_classes import CONFIG_CLASSES, MODEL_CLASSES
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
from .registration import register_all

__version__ = "0.2.0"


def __getattr__(name):
    # ONNX Runtime classes load on first use: `import hf_variants` does not need onnxruntime
    if name in ("OrtModelForSeq2SeqLM", "OrtEncoderOutput", "OrtCache", "OrtSharedCache"):
        from .onnx import modeling as modeling_ort

        return getattr(modeling_ort, name)
    raise AttributeError(f"module 'hf_variants' has no attribute {name!r}")


register_all()

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
    "OrtModelForSeq2SeqLM",
]
