"""Python examples in the docs run as written (on a tiny random model instead of the model
they name): docs/agents.md's episode driver.
Run: python -m pytest -q tests/test_docs_examples.py
"""

from __future__ import annotations

import re
from pathlib import Path

from engine_helpers import one_thread  # noqa: F401 (fixture)
from serve_helpers import write_model_folder

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _python_block(doc: str, marker: str) -> str:
    """The first ```python block after `marker` in docs/<doc>."""
    text = (DOCS / doc).read_text()
    start = text.index(marker)
    m = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert m, f"no python block after {marker!r} in {doc}"
    return m.group(1)


def test_agents_driver_example_runs(tmp_path, capsys, one_thread):
    """Before: the example imported RolloutConfig from rlfuse.rollout (it is not there) and
    never said how to build the llm or what a row is."""
    code = _python_block("agents.md", "**The driver**")
    folder = write_model_folder(tmp_path / "model")
    code, n = re.subn(r'^MODEL = ".*?"', f"MODEL = {str(folder)!r}", code, flags=re.M)
    assert n == 1
    namespace: dict = {}
    exec(compile(code, "docs/agents.md", "exec"), namespace)
    eps = namespace["episodes"]
    assert len(eps) == 4 and all(len(e.loss_mask) == len(e.token_ids) for e in eps)
    assert "rollout/turns_mean" in namespace["metrics"]
