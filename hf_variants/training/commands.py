"""The functions behind the console scripts that `pip install` adds (`[project.scripts]` in pyproject.toml).

`hf-variants-train`, `hf-variants-translate` and `hf-variants-average` are `train.cli`, `translate.cli` and
`average.cli`; the other commands keep their `python -m` modules, whose `main()` returns what it wrote (a console
script would exit with that value as an error status), so each function here runs one `main()` and exits 0 when it
returns:

| console script | same as |
| --- | --- |
| `hf-variants-export-onnx` | `python -m hf_variants.export_onnx` |
| `hf-variants-export-ctranslate2` | `python -m hf_variants.export_ctranslate2` |
| `hf-variants-convert-marian` | `python -m hf_variants.convert_marian` |
| `hf-variants-warm-start` | `python -m hf_variants.warm_start` |
| `hf-variants-publish` | `python -m model_cards.publish` (exit status 1 on a refused push) |
"""

from __future__ import annotations


def export_onnx() -> None:
    from ..onnx.export import main

    main()


def export_ctranslate2() -> None:
    from ..deploy.ctranslate2 import main

    main()


def convert_marian() -> None:
    from ..convert.marian import main

    main()


def warm_start() -> None:
    from ..convert.warm_start import main

    main()


def publish() -> int:
    from model_cards.publish import main

    return main()
