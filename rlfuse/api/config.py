"""A run's config from what a user has: a RunConfig, a dict, a YAML file or a built-in
recipe name, plus "a.b=value" overrides (the commands' --set).

A user's recipe names its inputs relative to its own folder; a built-in recipe's paths
(runs/<earlier stage>/final) are relative to the working directory.
Test: python -m pytest -q tests/test_api.py tests/test_train_cli.py
"""

from __future__ import annotations

from pathlib import Path

from rlfuse.run.config import RunConfig, load_config, to_dict

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
"""The built-in recipes (rlfuse/recipes/<name>.yaml)."""


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def resolve_config_path(name: str | Path) -> Path:
    """A YAML path, or the name of a built-in recipe."""
    path = Path(name)
    if path.exists():
        return path
    name = str(name)
    builtin = RECIPES / (name if name.endswith(".yaml") else f"{name}.yaml")
    if builtin.exists():
        return builtin
    raise ValueError(f"config {name!r}: no such file and no built-in recipe of that name "
                     f"(built-in recipes: {', '.join(recipe_names())})")


def load_run_config(config: RunConfig | dict | str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """The RunConfig of `config` (None: every default) with `overrides` applied."""
    overrides = list(overrides)
    if isinstance(config, RunConfig):
        return load_config(to_dict(config), overrides) if overrides else config
    if config is None or isinstance(config, dict):
        return load_config(dict(config or {}), overrides)
    path = resolve_config_path(config)
    builtin = path.resolve().parent == RECIPES
    return load_config(path, overrides, relative_to=None if builtin else path.resolve().parent)
