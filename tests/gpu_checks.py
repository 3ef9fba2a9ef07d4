"""Shared by the tests/test_gpu_*.py check tables: each test records named sub-checks
(PASS/FAIL lines printed with their numbers) and fails listing every failed one."""

import pytest
import torch


def assert_all_pass(rows: list[dict]) -> None:
    """Every sub-check recorded since the test started passed (failures listed by name)."""
    bad = [r for r in rows if not r["ok"]]
    assert not bad, f"{len(bad)}/{len(rows)} checks failed:\n" + "\n".join(map(str, bad))


def fresh_rows(rows: list[dict]):
    """An autouse fixture for a module: empties `rows` before each test and turns TF32 off
    (fp32 checks compare IEEE results)."""
    @pytest.fixture(autouse=True)
    def _fresh():
        rows.clear()
        torch.backends.cuda.matmul.allow_tf32 = False
        yield
    return _fresh


def record_into(rows: list[dict], check: str, ok: bool, **info) -> None:
    """Append one sub-check and print it as a PASS/FAIL line with its numbers."""
    rows.append(dict(check=check, ok=bool(ok), **info))
    print(f"{'PASS' if ok else 'FAIL'}  {check:58s} " + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
