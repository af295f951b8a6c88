"""The translation pipeline shipped with every hf_variants model.

transformers 5 removed the built-in `translation` task. Every hf_variants config carries
`custom_pipelines = {"translation": {"impl": "pipeline_translation.TranslationPipeline", ...}}`, and the modeling
file imports this module, so `save_pretrained` copies it next to the model code: then
`pipeline("translation", model=<folder or repo>, trust_remote_code=True)` works without this package installed.
After `import hf_variants`, `pipeline("translation", model=model, tokenizer=tokenizer)` works with objects too.

Output format of the former transformers pipeline: `[{"translation_text": ...}]` per input sentence.
"""

from __future__ import annotations

from transformers import GenerationConfig, Pipeline


class TranslationPipeline(Pipeline):
    """Translate sentences with an hf_variants model.

    Call with a string or a list of strings; `src_lang` / `tgt_lang` select the direction of multilingual models;
    generation parameters (`num_beams`, `max_new_tokens`, `do_sample`, ...) go to `generate()`; other keyword
    arguments are model inputs taken by the model's `prepare_translation_inputs` (e.g. MG-SA's `parses`), given
    one per sentence as a list.
    """

    _pipeline_calls_generate = True
    _load_processor = False
    _load_image_processor = False
    _load_video_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True
    _default_generation_config = GenerationConfig(num_beams=4, length_penalty=0.6, max_new_tokens=256)

    def _sanitize_parameters(self, src_lang=None, tgt_lang=None, max_length=None, clean_up_tokenization_spaces=None,
                             **kwargs):
        generation_keys = {key for key in vars(GenerationConfig()) if not key.startswith("_")}
        generation_keys.add("generation_config")
        forward_params = {key: kwargs.pop(key) for key in list(kwargs) if key in generation_keys}
        preprocess_params = dict(kwargs)  # model inputs (validated by the model)
        if src_lang is not None:
            preprocess_params["src_lang"] = src_lang
        if tgt_lang is not None:
            preprocess_params["tgt_lang"] = tgt_lang
        if max_length is not None:  # source truncation, as in the former pipeline's tokenizer call
            preprocess_params["max_length"] = max_length
        postprocess_params = {}
        if clean_up_tokenization_spaces is not None:
            postprocess_params["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        return preprocess_params, forward_params, postprocess_params

    def __call__(self, inputs, batch_size: int | None = None, **kwargs):
        """Translate `inputs` (a string or a list of strings) in batches of `batch_size` sentences."""
        single = isinstance(inputs, str)
        texts = [inputs] if single else list(inputs)
        if not texts or not all(isinstance(text, str) for text in texts):
            raise ValueError("TranslationPipeline takes a string or a non-empty list of strings.")
        preprocess, forward, postprocess = self._sanitize_parameters(**kwargs)
        preprocess = {**self._preprocess_params, **preprocess}
        forward = {**self._forward_params, **forward}
        postprocess = {**self._postprocess_params, **postprocess}
        size = batch_size or self._batch_size or 16
        results = []
        for start in range(0, len(texts), size):
            batch_params = {  # per-sentence lists (tgt_lang, parses, ...) are sliced with the batch
                key: value[start:start + size] if isinstance(value, (list, tuple)) and len(value) == len(texts)
                else value
                for key, value in preprocess.items()
            }
            results.extend(self.run_single(texts[start:start + size], batch_params, forward, postprocess))
        return results[0] if single and isinstance(results[0], list) else results

    def preprocess(self, texts, **model_input_kwargs):
        return self.model.prepare_translation_inputs(self.tokenizer, texts, **model_input_kwargs)

    def _forward(self, model_inputs, **generate_kwargs):
        model_inputs.pop("labels", None)
        batch = model_inputs["input_ids"].shape[0]
        output_ids = self.model.generate(**model_inputs, **self._prepare_generate_kwargs(generate_kwargs))
        return {"output_ids": output_ids.reshape(batch, -1, output_ids.shape[-1])}

    def postprocess(self, model_outputs, clean_up_tokenization_spaces=False):
        results = []
        for sequences in model_outputs["output_ids"]:
            texts = self.tokenizer.decode(sequences.tolist(), skip_special_tokens=True,
                                          clean_up_tokenization_spaces=clean_up_tokenization_spaces)
            records = [{"translation_text": text} for text in texts]
            results.append(records[0] if len(records) == 1 else records)
        return results


__all__ = ["TranslationPipeline"]
