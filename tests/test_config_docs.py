"""docs/configuration.md is generated from the config dataclasses: it must equal a fresh
`render()` (regenerate: python -m rlfuse.run.config.docs > docs/configuration.md), and
every key it documents has a type, a default and a meaning."""

from pathlib import Path

from rlfuse.run.config.docs import render
from rlfuse.run.config.io import leaves
from rlfuse.run.config.run_config import RunConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_configuration_md_is_up_to_date():
    assert DOC.read_text() == render(), (
        "docs/configuration.md is out of date: run `python -m rlfuse.run.config.docs > docs/configuration.md`")


def test_every_key_is_documented_with_its_meaning():
    text = render()
    undocumented = [x.key for x in leaves(RunConfig) if not x.doc]
    assert not undocumented, f"config fields without a docstring: {undocumented}"
    for x in leaves(RunConfig):
        assert f"| `{x.key}` |" in text, x.key
    assert "| `engine.max_num_seqs` | `int` | `256` |" in text
    assert "| `rewards[].name` | `str` | required |" in text
