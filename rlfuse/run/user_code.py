"""User code a recipe names: `package.module:function` or `path/to/file.py:function`
(reward functions, the data.map row transform). A relative FILE is resolved against the
recipe's folder when the recipe is loaded (rlfuse.run.config.resolve_input_paths).
Test: python -m pytest -q tests/test_rewards.py tests/test_hf_data.py
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable


def load_function(spec: str, what: str) -> Callable:
    """The function `spec` names; errors start with `what` (e.g. "reward 'f.py:score'")."""
    if ":" not in spec:
        raise ValueError(f"{what}: expected module:function or file.py:function")
    mod_name, fn_name = spec.rsplit(":", 1)
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.exists():
            raise ValueError(f"{what}: no such file {path}")
        mod_spec = importlib.util.spec_from_file_location(f"rlfuse_user_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_spec.name] = module
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise ValueError(f"{what}: cannot import module {mod_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{what}: module {mod_name!r} has no function {fn_name!r}")
    return fn
