"""Imports point down only: kernels -> model -> engine -> consistency -> train -> recipes -> cli.

An `ast` walk over every module: a module of layer L may import rlfuse modules of
layers <= L only (its own layer included). Triton is an optional dependency: only
`rlfuse/kernels/triton/` imports it, and no other module imports that package by an
import statement (the public ops reach it through `kernels.backend.triton_ops`, once a
backend resolves to "triton"); `test_no_triton` runs the package with triton hidden."""

import ast
from pathlib import Path

import pytest

LAYERS = ["utils", "kernels", "model", "engine", "consistency", "rollout", "train", "recipes", "cli"]
ROOT = Path(__file__).resolve().parents[1] / "rlfuse"


def _layer(modname: str) -> int | None:
    if modname == "rlfuse.__main__":  # `python -m rlfuse`: the command line
        return LAYERS.index("cli")
    parts = modname.split(".")
    if parts[0] != "rlfuse" or len(parts) < 2:
        return None
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def _imports(path: Path, modname: str):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the package
                base = modname.split(".")[: -node.level]
                yield node.lineno, ".".join(base + ([node.module] if node.module else []))
            elif node.module:
                yield node.lineno, node.module


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1] + ["__init__"]
        yield path, ".".join(parts)


def test_every_package_is_a_known_layer():
    for sub in ROOT.iterdir():
        if sub.is_dir() and (sub / "__init__.py").exists():
            assert sub.name in LAYERS, f"rlfuse/{sub.name} is not in the layer list {LAYERS}"


@pytest.mark.parametrize("path,modname", list(_modules()), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_imports_point_down(path, modname):
    own = _layer(modname)
    if own is None:
        own = -1  # rlfuse/__init__.py and top-level helpers import no layer
        own_name = "the package root"
    else:
        own_name = LAYERS[own]
    for lineno, target in _imports(path, modname):
        t = _layer(target)
        if t is None:
            assert not target.startswith("rlfuse.") or target.split(".")[1] in LAYERS, target
            continue
        assert t <= own, (f"{path.relative_to(ROOT.parent)}:{lineno} imports {target} "
                          f"({LAYERS[t]}) from {own_name}: imports must point down {LAYERS}")


TRITON_PKG = "rlfuse.kernels.triton"


@pytest.mark.parametrize("path,modname", list(_modules()), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_triton_only_inside_kernels_triton(path, modname):
    if modname.startswith(TRITON_PKG + "."):
        return
    for lineno, target in _imports(path, modname):
        where = f"{path.relative_to(ROOT.parent)}:{lineno} imports {target}"
        assert target.split(".")[0] != "triton", (f"{where}: triton is optional; Triton code goes in "
                                                  f"rlfuse/kernels/triton/")
        assert not (target == TRITON_PKG or target.startswith(TRITON_PKG + ".")), (
            f"{where}: reach the Triton half of an op through kernels.backend.triton_ops (imported only "
            f"when the backend resolves to triton)")


def test_triton_rule_catches_a_direct_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import triton.language as tl\nfrom rlfuse.kernels.triton.rmsnorm import rmsnorm\n")
    assert [t for _, t in _imports(bad, "rlfuse.kernels.bad")] == ["triton.language", "rlfuse.kernels.triton.rmsnorm"]


def test_layer_check_catches_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from rlfuse.train import trainer\n")
    assert [t for _, t in _imports(bad, "rlfuse.kernels.bad")] == ["rlfuse.train"]
    assert _layer("rlfuse.train") > _layer("rlfuse.kernels")
