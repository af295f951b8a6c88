"""`python -m hf_variants.training.score` (and `accelerate launch -m ...`): the module path of earlier
releases, kept as a launcher of `hf_variants.commands.score` (`hf-variants-score`)."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("hf_variants.commands.score", run_name="__main__", alter_sys=True)
