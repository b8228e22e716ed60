"""``ci/check_history_words.py``: work-log wording is flagged, ordinary uses of the words are not."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "ci" / "check_history_words.py"


def _checker():
    spec = importlib.util.spec_from_file_location("check_history_words", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_history_wording_is_flagged():
    findings = _checker().findings
    # The phrases are split in the source so that the tree itself holds none of them.
    for text in (
        "measured in the eighteenth session",
        "the eleventh head accepts more",
        "as in the 3rd session",
        "the Twentieth\nsession's code",  # wrapped over a line break
        "earlier sessions tried it",
        "at this session's start",
        "a few minutes a session",
        "the next lease",
        "issue 6's targets",
        "run by the lead through the device tool",
    ):
        assert findings(text), text
    assert findings("line one\nsee the ninth session")[0][0] == 2  # the line it starts on


def test_ordinary_uses_are_not_flagged():
    findings = _checker().findings
    for text in (
        '@pytest.fixture(scope="session")',
        "an HTTP session keeps the connection",
        "a training session on the GPU",
        "s = requests.Session()",
        "release_gil(); the GIL is released",
        "the DHCP lease expired",
        "session_id = 3",
        "the first pass over the data",
        "one sitting this round out keeps a copy",
        "a workaround for pytorch/pytorch issue 12345",
        "see the upstream issue #56",
    ):
        assert findings(text) == [], text


def test_the_tree_is_clean():
    run = subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
