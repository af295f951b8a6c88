"""Registration of every hf_variants model type with transformers' Auto classes (and `auto_map` on save), and the
`translation` pipeline task transformers 5 removed. `import hf_variants` runs `register_all()` once; every module
of the package (the command-line tools of `hf_variants.onnx`, `.deploy` and `.convert` included) is imported after
it, so none calls it again.

This module sits above the runtime subpackages (it names `OrtModelForSeq2SeqLM` for the pipeline task): nothing in
`hf_variants.onnx`, `.deploy` or `.convert` imports it."""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from .model_classes import MODEL_CLASSES
from .pipeline_translation import TranslationPipeline


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
    tokenizer=tok)` works after `import hf_variants`, and with a folder: a saved model (`AutoModelForSeq2SeqLM`) or an
    ONNX export (`OrtModelForSeq2SeqLM`, tried first: a folder without its manifest fails at once). Nothing else of
    the registry changes."""
    from transformers import pipelines

    from .onnx.modeling import OrtModelForSeq2SeqLM  # a folder from export_onnx (onnxruntime loads on use)

    pipelines.REMOVED_TASKS.pop("translation", None)
    if pipelines.PIPELINE_REGISTRY.supported_tasks.get("translation", {}).get("impl") is TranslationPipeline:
        return  # registered already (a second call would log "Overwriting pipeline")
    pipelines.PIPELINE_REGISTRY.register_pipeline(
        "translation",
        pipeline_class=TranslationPipeline,
        pt_model=(OrtModelForSeq2SeqLM, AutoModelForSeq2SeqLM),
        type="text",
    )


def register_all() -> None:
    """Register every model type (idempotent) and restore the `translation` pipeline task."""
    for classes in MODEL_CLASSES.values():
        _register(*classes)
    _restore_translation_task()
