"""transformers' own common model tests (ModelTesterMixin + GenerationTesterMixin + ConfigTester, the suite every
model inside transformers passes) on the six model types, and on the baseline in a converted M2M100 / NLLB-200's
layout (`peer_m2m100_layout.py`: pre-norm, fairseq positions, language tokens), through the harness in
`../shared/peer_tests` (its README; MarianMTModel passes it with 0 failures). The suite runs once, in a child
pytest (the harness has its own conftest and pytest.ini), and each model type is one test here: 0 failures, 0
errors.

Nothing is deselected or skipped on our side: every upstream test that applies runs (the harness itself skips what
needs an accelerator, Flash Attention or a Hub token). Without `../shared/peer_tests` (a clone on its own) the tests
skip and say so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PEER_DIR = Path(os.environ.get("PEER_TESTS_DIR", REPO_ROOT.parent / "shared" / "peer_tests"))
MODEL_FILES = {
    "transformer_nmt": "test_peer_transformer_nmt.py",
    "mute_nmt": "test_peer_mute.py",
    "hysan_nmt": "test_peer_hysan.py",
    "mgsa_nmt": "test_peer_mgsa.py",
    "mimo_nmt": "test_peer_mimo.py",
    "tied_nmt": "test_peer_tied.py",
    # the baseline in a converted M2M100 / NLLB-200's layout (pre-norm, fairseq positions, language tokens): this
    # repository's file, run by the same harness
    "transformer_nmt (M2M100 layout)": str(REPO_ROOT / "modeling_tests" / "peer_m2m100_layout.py"),
}


# the test class of each file that lies outside the harness's rootdir: pytest's junit report names only the class
# (".TransformerNmtM2M100LayoutPeerTest"), not the file
OUTSIDE_CLASSES = {"TransformerNmtM2M100LayoutPeerTest": MODEL_FILES["transformer_nmt (M2M100 layout)"]}


def _file_of(case) -> str:
    """The MODEL_FILES entry a junit test case belongs to (its file's stem in the class name, or its class)."""
    classname = case.get("classname", "")
    found = next((f for f in MODEL_FILES.values() if Path(f).stem in classname), None)
    if found is None:
        found = OUTSIDE_CLASSES.get(classname.rsplit(".", 1)[-1])
    return found or Path(case.get("file") or classname.replace(".", "/") + ".py").name


@pytest.fixture(scope="module")
def peer_results(tmp_path_factory):
    if not (PEER_DIR / "run.sh").is_file():
        pytest.skip(
            f"transformers' common tests are not here ({PEER_DIR} has no run.sh): they ship beside the "
            "repository in ../shared/peer_tests (CI has them); set PEER_TESTS_DIR to run them elsewhere"
        )
    report = tmp_path_factory.mktemp("peer") / "junit.xml"
    env = {**os.environ, "PYTHON": sys.executable}
    command = [
        "bash",
        str(PEER_DIR / "run.sh"),
        *MODEL_FILES.values(),
        "-q",
        "-p",
        "no:randomly",
        "--timeout",
        "900",
        f"--junitxml={report}",
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if not report.exists():
        pytest.fail(f"the peer suite did not run:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        file = _file_of(case)
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes.setdefault(file, []).append(
            (case.get("name"), kinds[0] if kinds else "passed", next((c.get("message", "") for c in case), ""))
        )
    return outcomes, result.stdout


@pytest.mark.parametrize("model_type", list(MODEL_FILES))
def test_transformers_common_suite(model_type, peer_results):
    outcomes, stdout = peer_results
    cases = outcomes.get(MODEL_FILES[model_type], [])
    counts = Counter(kind for _, kind, _ in cases)
    assert counts["passed"] > 100, (counts, stdout[-2000:])  # the suite ran for this model
    broken = [(name, kind, message[:300]) for name, kind, message in cases if kind in ("failure", "error")]
    assert not broken, f"{model_type}: {len(broken)} upstream tests fail: {broken}"
