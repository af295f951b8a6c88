"""Baseline Transformer: the common checks, plus Marian equivalence, presets and the pipeline registration."""

from __future__ import annotations

import pytest
import torch

import hf_variants
from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration
from common import NmtModelTester


class TestTransformerNmt(NmtModelTester):
    model_type = "transformer_nmt"

    def make_config(self, **overrides):
        return TransformerNmtConfig.from_preset("tiny", **overrides)


class TestTransformerNmtPreNormRelative(NmtModelTester):
    """Pre-norm, learned positions and Shaw relative keys+values (MUTE's setting) through the same checks."""

    model_type = "transformer_nmt"

    def make_config(self, **overrides):
        return TransformerNmtConfig.from_preset("tiny", normalize_before=True, max_relative_positions=3,
                                                relative_position_values=True, **overrides)
