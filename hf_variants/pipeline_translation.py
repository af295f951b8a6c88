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

from .generation_transformer_nmt import check_tokenizer_fits_model


class TranslationPipeline(Pipeline):
    """Translate sentences with an hf_variants model.

    Call with a string or a list of strings; `src_lang` / `tgt_lang` select the direction of multilingual models;
    generation parameters (`num_beams`, `max_length`, `max_new_tokens`, `do_sample`, ...) go to `generate()` as
    given, on top of the model's `generation_config` (which carries the papers' beam 4 and length penalty 0.6);
    other keyword arguments are model inputs taken by the model's `prepare_translation_inputs` (e.g. MG-SA's
    `parses`), given one per sentence as a list.

    As in the transformers 4 translation pipeline, `max_length` is the generation length limit, not a source
    truncation. A source longer than the model accepts (`config.max_position_embeddings` tokens, special tokens
    included) raises a `ValueError` naming its length and the limit, unless `truncation=True` cuts it to the limit.
    An empty or whitespace-only input translates to `""` without running the model. A tokenizer with more tokens
    than the model's vocabulary (`len(tokenizer)` > `config.vocab_size`) is refused when the pipeline is built.
    """

    _pipeline_calls_generate = True
    _load_processor = False
    _load_image_processor = False
    _load_video_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True
    # No pipeline defaults: the model's generation_config holds the decoding defaults (beam 4, length penalty 0.6
    # and the length rule), so `pipeline(x)` decodes exactly like `model.generate(**inputs)`, and a user's
    # `max_length` / `max_new_tokens` reaches generate() untouched.
    _default_generation_config = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.tokenizer is not None:
            check_tokenizer_fits_model(self.tokenizer, self.model.config)

    def _sanitize_parameters(
        self, src_lang=None, tgt_lang=None, truncation=None, clean_up_tokenization_spaces=None, **kwargs
    ):
        generation_keys = {key for key in vars(GenerationConfig()) if not key.startswith("_")}
        generation_keys.add("generation_config")
        forward_params = {key: kwargs.pop(key) for key in list(kwargs) if key in generation_keys}
        preprocess_params = dict(kwargs)  # model inputs (validated by the model)
        if src_lang is not None:
            preprocess_params["src_lang"] = src_lang
        if tgt_lang is not None:
            preprocess_params["tgt_lang"] = tgt_lang
        if truncation is not None:
            preprocess_params["truncation"] = truncation
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
        # empty inputs translate to "" without a model call; the others keep their order
        keep = [i for i, text in enumerate(texts) if text.strip()]
        empty = {"translation_text": ""}
        copies = self._num_return_sequences(forward)
        results = [[dict(empty) for _ in range(copies)] if copies > 1 else dict(empty) for _ in texts]
        for start in range(0, len(keep), size):
            rows = keep[start : start + size]
            batch_params = {  # per-sentence lists (tgt_lang, parses, ...) follow their sentences
                key: [value[i] for i in rows]
                if isinstance(value, (list, tuple)) and len(value) == len(texts)
                else value
                for key, value in preprocess.items()
            }
            batch_params["_rows"] = rows if not single else None
            translated = self.run_single([texts[i] for i in rows], batch_params, forward, postprocess)
            for i, result in zip(rows, translated):
                results[i] = result
        return results[0] if single and isinstance(results[0], list) else results

    def _num_return_sequences(self, forward_params: dict) -> int:
        """How many translations each input gets (what `generate()` will use)."""
        kwargs = (
            forward_params if "generation_config" in forward_params else {**self._generate_kwargs, **forward_params}
        )
        if kwargs.get("num_return_sequences") is not None:
            return int(kwargs["num_return_sequences"])
        config = kwargs.get("generation_config") or self.model.generation_config
        return int(getattr(config, "num_return_sequences", None) or 1)

    def preprocess(self, texts, truncation=None, _rows=None, **model_input_kwargs):
        limit = getattr(self.model.config, "max_position_embeddings", None)
        truncate = truncation not in (None, False, "do_not_truncate")
        if truncate and limit is None:
            raise ValueError(
                f"truncation={truncation!r}: {type(self.model.config).__name__} has no "
                f"`max_position_embeddings` to truncate to."
            )
        model_inputs = self.model.prepare_translation_inputs(
            self.tokenizer, texts, max_length=limit if truncate else None, **model_input_kwargs
        )
        if limit is not None:
            mask = model_inputs.get("attention_mask")
            lengths = (
                mask.sum(-1)
                if mask is not None
                else model_inputs["input_ids"].new_full(
                    model_inputs["input_ids"].shape[:1], model_inputs["input_ids"].shape[-1]
                )
            )
            longest = int(lengths.argmax())
            if int(lengths[longest]) > limit:
                which = "The input" if _rows is None else f"inputs[{_rows[longest]}]"
                raise ValueError(
                    f"{which} is {int(lengths[longest])} tokens long (special tokens included), but "
                    f"this model accepts at most {limit} (config.max_position_embeddings). Shorten or "
                    f"split it, or pass truncation=True to cut it to {limit} tokens."
                )
        return model_inputs

    def _forward(self, model_inputs, **generate_kwargs):
        model_inputs.pop("labels", None)
        batch = model_inputs["input_ids"].shape[0]
        output_ids = self.model.generate(**model_inputs, **self._prepare_generate_kwargs(generate_kwargs))
        return {"output_ids": output_ids.reshape(batch, -1, output_ids.shape[-1])}

    def postprocess(self, model_outputs, clean_up_tokenization_spaces=False):
        results = []
        for sequences in model_outputs["output_ids"]:
            texts = self.tokenizer.decode(
                sequences.tolist(), skip_special_tokens=True, clean_up_tokenization_spaces=clean_up_tokenization_spaces
            )
            records = [{"translation_text": text} for text in texts]
            results.append(records[0] if len(records) == 1 else records)
        return results


__all__ = ["TranslationPipeline", "check_tokenizer_fits_model"]
