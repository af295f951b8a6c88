"""transformers' own common tests (the harness of `../shared/peer_tests`) on the baseline in the layout of a converted
M2M100 / NLLB-200 model (`hf-variants-convert-m2m100`): pre-norm with final LayerNorms, fairseq's padding-aware
sinusoidal positions, `init_method="normal"`, and language tokens with the target language's token forced after the
decoder start token (one target language recorded, so the suite's `generate()` calls need no `tgt_lang`).

Not collected by the package's own pytest run (no `test_` prefix): `test_peer_suite.py` passes it to the harness's
`run.sh` beside the harness's own files.
"""

import os
import sys
import unittest
from pathlib import Path

PEER_DIR = Path(os.environ.get("PEER_TESTS_DIR", Path(__file__).resolve().parents[2] / "shared" / "peer_tests"))
if str(PEER_DIR) not in sys.path:
    sys.path.insert(0, str(PEER_DIR))

from peer_harness import PeerSeq2SeqModelTest, Seq2SeqModelTester  # noqa: E402

from hf_variants import (  # noqa: E402
    TransformerNmtConfig,
    TransformerNmtForConditionalGeneration,
    TransformerNmtModel,
)

M2M100_LAYOUT = {
    "position_embedding_type": "fairseq_sinusoidal",
    "normalize_before": True,
    "init_method": "normal",
    "languages": ["xx_Latn", "yy_Latn"],
    "language_token_ids": [97, 98],
    "target_languages": ["yy_Latn"],
    "target_language_token": True,
}


class M2M100LayoutTester(Seq2SeqModelTester):
    """The harness's tester with the decoder inputs clamped above the padding id, as transformers' own M2M100 tester
    does (tests/models/m2m_100/test_modeling_m2m_100.py): fairseq's positions skip padding tokens, which input ids
    show and embeddings do not, so a padding token inside a random decoder input would make `input_ids` and
    `inputs_embeds` (and a cache continued from either) place the later tokens differently, by design."""

    def prepare_config_and_inputs(self):
        config, inputs = super().prepare_config_and_inputs()
        inputs["decoder_input_ids"] = inputs["decoder_input_ids"].clamp(self.pad_token_id + 1)
        return config, inputs


class TransformerNmtM2M100LayoutPeerTest(PeerSeq2SeqModelTest, unittest.TestCase):
    config_class = TransformerNmtConfig
    all_model_classes = (TransformerNmtModel, TransformerNmtForConditionalGeneration)
    base_model_class = TransformerNmtModel
    tester_kwargs = {"extra_config_kwargs": M2M100_LAYOUT}
    config_tester_kwargs = M2M100_LAYOUT
    test_missing_keys = False  # shared embeddings are saved once

    def setUp(self):
        super().setUp()
        self.model_tester = M2M100LayoutTester(self, self.config_class, **self.tester_kwargs)
