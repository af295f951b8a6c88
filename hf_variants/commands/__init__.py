"""The command-line front ends: flags and files in, calls into the library (`inference`, `training`, `onnx`,
`deploy`, `convert`, `serve`) out. Each console script of `[project.scripts]` is a `cli()` of a module here; the
older module paths (`python -m hf_variants.training.translate`, ...) stay as launchers that call them.
"""
