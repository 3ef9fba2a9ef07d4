"""Imports point down only: kernels -> model -> engine -> consistency -> run -> data -> rollout ->
train -> api -> serve -> recipes -> cli.

An `ast` walk over every module: a module of layer L may import rlfuse modules of
layers <= L only (its own layer included). The package root (rlfuse/__init__.py)
re-exports the Python API, so it is of layer api, and so is `from rlfuse import ...`.
Triton is an optional dependency: only the Triton halves of the op families
(`rlfuse/kernels/<family>/triton_<op>.py`) and their shared helpers (`rlfuse/kernels/triton_common.py`)
import it, and no other module imports them by an import statement (the public ops reach them through
`kernels.backend.triton_ops`, once a backend resolves to "triton"); `test_no_triton` runs the package
with triton hidden."""

import ast
from pathlib import Path

import pytest

LAYERS = ["utils", "kernels", "model", "engine", "consistency", "run", "data", "rollout", "train", "api", "serve",
          "recipes", "cli"]
ROOT = Path(__file__).resolve().parents[1] / "rlfuse"


def _layer(modname: str) -> int | None:
    if modname == "rlfuse.__main__":  # `python -m rlfuse`: the command line
        return LAYERS.index("cli")
    if modname in ("rlfuse", "rlfuse.__init__"):  # the root re-exports the Python API (`from rlfuse import ...`)
        return LAYERS.index("api")
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


SUB_ROOMS = {
    "model": {"arch", "layers", "vision"},  # the architecture registry; the shared blocks it assembles; the vision tower
    # per-sequence cache state (KV blocks, KV pool, state slots); one step on the model; the generation benchmark
    "engine": {"cache", "step", "benchmark"},
    "run": {"config", "distributed"},
    "rollout": {"agent"},  # multi-turn: chat, tools, sandbox, environments, episodes
}
"""The rooms inside a layer. A new capability is a new room named here (op families under
`kernels/` are free: `test_kernels_are_families` checks their shape instead)."""


def test_every_sub_package_is_a_named_room():
    for layer in (p for p in ROOT.iterdir() if p.is_dir() and p.name in LAYERS and p.name != "kernels"):
        found = {d.name for d in layer.iterdir() if d.is_dir() and (d / "__init__.py").exists()}
        assert found == SUB_ROOMS.get(layer.name, set()), (
            f"rlfuse/{layer.name}/ has the rooms {sorted(found)}; tests/test_layering.py names "
            f"{sorted(SUB_ROOMS.get(layer.name, set()))} (name a new room in SUB_ROOMS)")
    for layer, rooms in SUB_ROOMS.items():
        for room in rooms:
            init = ROOT / layer / room / "__init__.py"
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc, f"{init}: its docstring says what the room is for"


@pytest.mark.parametrize("path,modname", list(_modules()), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_imports_point_down(path, modname):
    own = _layer(modname)
    if own is None:
        own = -1  # top-level helpers import no layer
        own_name = "a top-level module"
    else:
        own_name = LAYERS[own]
    for lineno, target in _imports(path, modname):
        t = _layer(target)
        if t is None:
            assert not target.startswith("rlfuse.") or target.split(".")[1] in LAYERS, target
            continue
        assert t <= own, (f"{path.relative_to(ROOT.parent)}:{lineno} imports {target} "
                          f"({LAYERS[t]}) from {own_name}: imports must point down {LAYERS}")


def _is_triton_module(modname: str) -> bool:
    """Triton code lives in an op family's `triton_*.py` (`rlfuse/kernels/<family>/triton_<op>.py`)
    or in the families' shared `rlfuse/kernels/triton_common.py` (`kernels.backend.is_triton_module`
    says the same; this test reads no rlfuse code)."""
    parts = modname.split(".")
    return parts[:2] == ["rlfuse", "kernels"] and len(parts) >= 3 and parts[-1].startswith("triton_")


@pytest.mark.parametrize("path,modname", list(_modules()), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_triton_only_in_triton_modules(path, modname):
    if _is_triton_module(modname):
        return
    for lineno, target in _imports(path, modname):
        where = f"{path.relative_to(ROOT.parent)}:{lineno} imports {target}"
        assert target.split(".")[0] != "triton", (f"{where}: triton is optional; Triton code goes in "
                                                  f"a family's rlfuse/kernels/<family>/triton_<op>.py")
        assert not _is_triton_module(target), (
            f"{where}: reach the Triton half of an op through kernels.backend.triton_ops (imported only "
            f"when the backend resolves to triton)")


def test_family_triton_modules_are_recognised():
    from rlfuse.kernels.backend import is_triton_module

    for name, want in [("rlfuse.kernels.gated_delta.triton_chunk", True), ("rlfuse.kernels.norm.triton_rms", True),
                       ("rlfuse.kernels.triton_common", True), ("rlfuse.kernels.gated_delta.chunk", False),
                       ("rlfuse.kernels.backend", False), ("rlfuse.model.triton_x", False)]:
        assert _is_triton_module(name) is want and is_triton_module(name) is want, name


def test_kernels_are_families():
    """rlfuse/kernels/ holds the shared helpers (backend, invariant, triton_common) and one folder
    per op family; no op module sits at the top level and no family nests another."""
    top = sorted(p.stem for p in (ROOT / "kernels").glob("*.py") if p.name != "__init__.py")
    assert top == ["backend", "invariant", "triton_common"], top
    for fam in (p for p in (ROOT / "kernels").iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert (fam / "__init__.py").exists(), f"rlfuse/kernels/{fam.name}/ is not a package"
        assert not [d for d in fam.iterdir() if d.is_dir() and d.name != "__pycache__"], (
            f"rlfuse/kernels/{fam.name}/ nests a folder: an op family is one level")


def test_triton_rule_catches_a_direct_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import triton.language as tl\nfrom rlfuse.kernels.norm.triton_rms import rmsnorm\n")
    assert [t for _, t in _imports(bad, "rlfuse.kernels.bad")] == ["triton.language", "rlfuse.kernels.norm.triton_rms"]


def test_layer_check_catches_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from rlfuse.train import trainer\n")
    assert [t for _, t in _imports(bad, "rlfuse.kernels.bad")] == ["rlfuse.train"]
    assert _layer("rlfuse.train") > _layer("rlfuse.kernels")


ROOMS = ("run", "data", "rollout", "train")
"""Rooms whose `__init__` is the one way in: a module of another layer imports their names
from the package (`from rlfuse.run import RunConfig`), not from the module that defines
them. `rlfuse.run.report` is the exception: it imports matplotlib, so it stays a module
import for the two places that write reports."""
MODULE_IMPORTS = {"rlfuse.run.report"}


@pytest.mark.parametrize("path,modname", list(_modules()), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_other_layers_enter_a_room_through_its_package(path, modname):
    own = modname.split(".")[1] if modname.count(".") else None
    for lineno, target in _imports(path, modname):
        parts = target.split(".")
        if parts[0] != "rlfuse" or len(parts) < 3 or parts[1] not in ROOMS or parts[1] == own:
            continue
        if target in MODULE_IMPORTS:
            continue
        pkg = ".".join(parts[:3]) if (ROOT / parts[1] / parts[2] / "__init__.py").exists() else ".".join(parts[:2])
        assert target == pkg, (f"{path.relative_to(ROOT.parent)}:{lineno} imports {target}: import from "
                               f"{pkg} (its __init__ exports what neighbours use)")


MAX_MODULE_LINES = 450  # the house's ~400-line soft cap, with the margin the before-stop check uses
MAX_PACKAGE_MODULES = 12
MAX_PACKAGE_SHARE = 0.30


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_too_long():
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py") if (n := _lines(p)) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split along a seam the code has): {long}"


def test_no_package_is_crowded():
    crowded = {}
    for d in [ROOT, *[p for p in ROOT.rglob("*") if p.is_dir() and (p / "__init__.py").exists()]]:
        n = len([p for p in d.glob("*.py") if p.name != "__init__.py"])
        if n > MAX_PACKAGE_MODULES:
            crowded[str(d.relative_to(ROOT.parent))] = n
    assert not crowded, f"packages with more than {MAX_PACKAGE_MODULES} modules at one level: {crowded}"


def test_no_room_holds_too_much_of_the_library():
    total = sum(_lines(p) for p in ROOT.rglob("*.py"))
    shares = {sub.name: sum(_lines(p) for p in sub.rglob("*.py")) / total
              for sub in ROOT.iterdir() if sub.is_dir() and (sub / "__init__.py").exists()}
    big = {k: round(v, 3) for k, v in shares.items() if v > MAX_PACKAGE_SHARE}
    assert not big, f"rooms holding more than {MAX_PACKAGE_SHARE:.0%} of the library's lines: {big}"
