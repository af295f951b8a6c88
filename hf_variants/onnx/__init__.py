"""ONNX export and ONNX Runtime inference for hf_variants models.

- `export`: `export_onnx()` and its command line (`python -m hf_variants.export_onnx`), with `attention` (fused
  attention ops for the exporter) and `quantization` (int8 graphs);
- `modeling`: `OrtModelForSeq2SeqLM`, the runtime model (`hf_variants.OrtModelForSeq2SeqLM` loads it lazily);
- the decoding paths it runs (`generation`, `bound`).

Nothing in a saved model's code imports this package.
"""
