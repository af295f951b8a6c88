"""`python -m hf_variants.serve`: the same as `hf-variants-serve` (`hf_variants.commands.serve`)."""

import runpy

runpy.run_module("hf_variants.commands.serve", run_name="__main__", alter_sys=True)
