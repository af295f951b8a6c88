"""Training, translation and evaluation scripts for hf_variants models (not shipped with models).

Run the scripts by path (`accelerate launch training/train.py`); tests import the modules as `training.<module>`
with the repository root on `sys.path`.
"""
