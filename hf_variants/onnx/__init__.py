"""ONNX export and ONNX Runtime inference for hf_variants models.

- `export`: `export_onnx()` and its command line (`python -m hf_variants.export_onnx`), with `attention` (fused
  attention ops for the exporter) and `quantization` (int8 graphs);
- `modeling`: `OrtModelForSeq2SeqLM`, the runtime model (`hf_variants.OrtModelForSeq2SeqLM` loads it lazily);
- `decoding`: which decoding path `generate()` runs and why (the bound search, `bound`, or transformers' loop);
- `manifest`: `read_manifest()`, the exported folder's manifest read back as untrusted input.

Nothing in a saved model's code imports this package.
"""
