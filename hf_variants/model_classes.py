"""The model types of hf_variants and their classes: one table that the registration (registration.py), the ONNX
Runtime model (modeling_ort.py), the exporters and the converters read."""

from .configuration_hysan import HysanConfig
from .configuration_mgsa import MgsaConfig
from .configuration_mimo import MimoConfig
from .configuration_mute import MuteConfig
from .configuration_tied import TiedTransformerConfig
from .configuration_transformer_nmt import TransformerNmtConfig
from .modeling_hysan import HysanForConditionalGeneration, HysanModel
from .modeling_mgsa import MgsaForConditionalGeneration, MgsaModel
from .modeling_mimo import MimoForConditionalGeneration, MimoModel
from .modeling_mute import MuteForConditionalGeneration, MuteModel
from .modeling_tied import TiedTransformerForConditionalGeneration, TiedTransformerModel
from .modeling_transformer_nmt import TransformerNmtForConditionalGeneration, TransformerNmtModel

# model_type -> (config class, base model class, generation model class).
MODEL_CLASSES = {
    "transformer_nmt": (TransformerNmtConfig, TransformerNmtModel, TransformerNmtForConditionalGeneration),
    "mute_nmt": (MuteConfig, MuteModel, MuteForConditionalGeneration),
    "hysan_nmt": (HysanConfig, HysanModel, HysanForConditionalGeneration),
    "mgsa_nmt": (MgsaConfig, MgsaModel, MgsaForConditionalGeneration),
    "mimo_nmt": (MimoConfig, MimoModel, MimoForConditionalGeneration),
    "tied_nmt": (TiedTransformerConfig, TiedTransformerModel, TiedTransformerForConditionalGeneration),
}

CONFIG_CLASSES = {model_type: classes[0] for model_type, classes in MODEL_CLASSES.items()}
