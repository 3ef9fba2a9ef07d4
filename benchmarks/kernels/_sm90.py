"""Offline sm_90 compile + `ptxas -v` for the compile_*_sm90.py scripts (no GPU needed):
the bundled ptxas, and registers / spill bytes of one compiled kernel. Imported as `_sm90`
(the scripts run from this directory)."""

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def ptxas() -> str:
    for name in ("ptxas-blackwell", "ptxas"):  # the newest bundled one understands this triton's PTX
        if os.path.exists(os.path.join(BIN, name)):
            return os.path.join(BIN, name)
    raise SystemExit(f"no ptxas under {BIN}")


def compile_sm90(fn, sig: dict, constexprs: dict, options: dict, attrs: dict | None = None):
    """-> (compiled kernel, its PTX, registers per thread, spill-store bytes); -1 where
    ptxas printed no such line."""
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, **({"attrs": attrs} if attrs else {}))
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([ptxas(), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                       capture_output=True, text=True)
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", r.stderr)
    spill = re.findall(r"(\d+) bytes spill stores", r.stderr)
    return k, ptx, int(regs[0]) if regs else -1, int(spill[0]) if spill else -1
