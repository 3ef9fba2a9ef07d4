"""`rlfuse serve` survives any request: each request that once took the engine down (issue
37) is a 400 in OpenAI's shape, a failure inside an engine step fails only the requests
live in it and the engine goes on, and a few hundred random-but-typed requests leave
/health at 200 and the next request served. Loopback only (tests/serve_helpers.py).
Test: python -m pytest -q tests/test_serve_faults.py"""

from __future__ import annotations

import json
import math
import random
import time
import types
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from engine_helpers import one_thread  # noqa: F401,E402 (fixture)
from serve_helpers import LocalServer, write_model_folder  # noqa: E402

from rlfuse.api import load_model  # noqa: E402
from rlfuse.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from rlfuse.serve import build_app  # noqa: E402
from rlfuse.serve.app import _Call  # noqa: E402

NAME = "tiny"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("serve_faults_model"))


@pytest.fixture(scope="module")
def server(folder):
    model, tok = load_model(folder, device="cpu")
    llm = LLM(model, tok, EngineConfig(max_model_len=160, max_num_seqs=8, num_kv_blocks=24))
    with LocalServer(build_app(llm, NAME)) as s:
        s.llm = llm
        s.worker = s.server.config.app.state.serve.worker
        yield s


def _post(server, path: str, body, timeout: float = 30) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (raw.decode() if body_is_stream(data) else json.loads(raw))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def body_is_stream(data: bytes) -> bool:
    try:
        return bool(json.loads(data).get("stream"))
    except (ValueError, AttributeError):
        return False


def _served(server) -> None:
    """/health is 200 and a plain request is answered."""
    status, body = _post(server, "/v1/completions", {"model": NAME, "prompt": "abc", "max_tokens": 3,
                                                     "temperature": 0})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"


def _is_openai_error(body, status: int) -> None:
    assert isinstance(body, dict) and set(body["error"]) >= {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    if status >= 500:
        assert body["error"]["type"] == "server_error"


@pytest.mark.parametrize("extra,param", [
    (dict(min_tokens=2, stop_token_ids=[1000000]), "stop_token_ids"),   # once an IndexError in the runner
    (dict(stop_token_ids=[264]), "stop_token_ids"),                      # the first id past the vocab
    (dict(top_k=2**63), "top_k"),                                        # once an OverflowError
    (dict(top_k=2**31), "top_k"),                                        # past int32
    (dict(top_k=265), "top_k"),                                          # past the vocabulary (264)
    (dict(temperature=1e-40, logprobs=0), "temperature"),                # once NaN log-probs: a 500
    (dict(prompt=[[3, 2**40]]), "prompt"),
], ids=["stop-id-huge", "stop-id-vocab", "top-k-2**63", "top-k-int32", "top-k-vocab", "temperature-1e-40",
        "prompt-id-huge"])
def test_request_that_killed_the_engine_is_a_400(server, extra, param):
    body = {"model": NAME, "prompt": "abc", "max_tokens": 4, **extra}
    status, err = _post(server, "/v1/completions", body)
    assert status == 400, err
    _is_openai_error(err, status)
    assert param in (err["error"]["param"] or "") + err["error"]["message"]
    _served(server)


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800abc", "max_tokens": 2}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": "abc", "stop": ["\\udfff"], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}'),
], ids=["prompt", "stop", "chat"])
def test_lone_surrogate_is_a_400(server, route, body):
    status, err = _post(server, route, body)
    assert status == 400, err
    _is_openai_error(err, status)
    assert "surrogate" in err["error"]["message"]
    _served(server)


def test_non_finite_logprobs_are_null_in_json():
    """A NaN or inf log-prob (none is expected after the temperature floor) is sent as null:
    JSON has no NaN, and json.dumps(allow_nan=False) in the response made it a 500."""
    app = types.SimpleNamespace(token_text=lambda t: "x")
    for kind, req in (("completion", types.SimpleNamespace(logprobs=0)),
                      ("chat", types.SimpleNamespace(logprobs=True))):
        call = _Call(app, kind, req, [[1]], SamplingParams())
        d = call._logprobs([1, 2, 3], [float("nan"), -math.inf, -0.5])
        json.dumps(d, allow_nan=False)
        got = d["token_logprobs"] if kind == "completion" else [c["logprob"] for c in d["content"]]
        assert got == [None, None, -0.5]


def test_sampling_params_floor_and_int32():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=1e-40)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**31)
    SamplingParams(temperature=1e-5, top_k=2**31 - 1)  # the edges are accepted


def test_engine_step_failure_fails_the_request_not_the_server(server, monkeypatch):
    """An unforeseen failure inside a step: the engine drops its state and re-runs the request
    alone (probation). A failure that does not come back (here: the first launch only) costs
    the request nothing; one that does fails that request with a 500 in OpenAI's shape. The
    engine keeps serving either way."""
    runner = server.llm.runner
    real = runner.launch
    calls = {"n": 0, "fail": {1}}

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] in calls["fail"]:
            raise RuntimeError("injected step failure")
        return real(*a, **k)
    monkeypatch.setattr(runner, "launch", failing)
    before = server.worker.failures
    status, body = _post(server, "/v1/completions", {"model": NAME, "prompt": "abc", "max_tokens": 4})
    assert status == 200 and server.worker.failures == before + 1, body  # transient: re-run and answered
    calls["n"], calls["fail"] = 0, {1, 2}  # fails in the batch and again alone
    status, err = _post(server, "/v1/completions", {"model": NAME, "prompt": "abc", "max_tokens": 4})
    assert status == 500, err
    _is_openai_error(err, status)
    assert "injected step failure" in err["error"]["message"]
    assert server.worker.failures == before + 3 and server.worker.alive
    _served(server)
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert json.loads(r.read())["step_failures"] == before + 3
    bm = server.llm.block_manager
    assert bm.num_free == bm.num_blocks


def test_abort_all_leaves_the_engine_idle_and_usable(folder, one_thread):  # noqa: F811 (the fixture)
    model, tok = load_model(folder, device="cpu")
    llm = LLM(model, tok, EngineConfig(max_model_len=96, max_num_seqs=4, num_kv_blocks=16))
    want = llm.generate([[65, 66, 67]], SamplingParams(max_tokens=6, temperature=0))[0].output_token_ids
    llm.add_request([65, 66, 67], SamplingParams(max_tokens=20, temperature=0, n=2))
    llm.step()
    llm.step()
    llm.abort_all()
    assert not llm.has_unfinished() and llm.block_manager.num_free == llm.block_manager.num_blocks
    assert llm.generate([[65, 66, 67]], SamplingParams(max_tokens=6, temperature=0))[0].output_token_ids == want


_INTS = [-(2**63), -2, -1, 0, 1, 2, 3, 7, 263, 264, 265, 2**31 - 1, 2**31, 2**63, 10**30]
_FLOATS = [0.0, 1e-300, 1e-40, 1e-6, 1e-5, 0.3, 1.0, 2.0, 1e30, -0.5, 1e308]
_TEXTS = ["a", "abc", "hello world", "\ud800", "x\udfffy", "\x00", "é😀", "<|im_end|>", "x" * 300]


def _fuzz_value(rng: random.Random, kind: str):
    """Mostly ordinary values (so that many requests reach the engine), 1 in 4 an edge."""
    if kind == "int" and rng.random() < 0.75:
        return rng.randrange(1, 4)
    if kind == "float" and rng.random() < 0.75:
        return rng.choice([0.5, 0.9, 1.0])
    if kind == "int":
        return rng.choice(_INTS)
    if kind == "float":
        return rng.choice(_FLOATS + _INTS[3:8])
    if kind == "bool":
        return rng.choice([True, False])
    if kind == "text":
        return rng.choice(_TEXTS)
    if kind == "ids":
        return [rng.choice(_INTS) if rng.random() < 0.2 else rng.randrange(260) for _ in range(rng.randrange(4))]
    if kind == "stop":
        return rng.choice([None, rng.choice(_TEXTS), [rng.choice(_TEXTS) for _ in range(rng.randrange(3))]])
    raise AssertionError(kind)


_FIELDS = dict(n="int", temperature="float", top_p="float", max_tokens="int", seed="int", top_k="int",
               min_p="float", min_tokens="int", stop_token_ids="ids", ignore_eos="bool", stop="stop",
               skip_special_tokens="bool", return_token_ids="bool", logprobs="int", stream="bool")


def _fuzz_request(rng: random.Random) -> tuple[str, dict]:
    body: dict = {"model": NAME}
    for name, kind in _FIELDS.items():
        if rng.random() < 0.3:
            body[name] = _fuzz_value(rng, kind)
    # keep generation short: a fuzz case is about the request's shape, not its length
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 3:
        body["max_tokens"] = rng.choice([1, 2, 3])
    if isinstance(body.get("n"), int) and body["n"] > 3:
        body["n"] = rng.choice([1, 2, 3, 200])
    if rng.random() < 0.5:
        roles = ["user", "system", "assistant", "tool", ""]
        body["messages"] = [{"role": rng.choice(roles), "content": _fuzz_value(rng, "text")}
                            for _ in range(rng.randrange(3))]
        body["logprobs"] = rng.choice([True, False])
        return "/v1/chat/completions", body
    body["prompt"] = rng.choice([_fuzz_value(rng, "text"), _fuzz_value(rng, "ids"),
                                 [_fuzz_value(rng, "text"), _fuzz_value(rng, "ids")]])
    return "/v1/completions", body


def test_fuzz_random_typed_requests_never_break_the_server(server):
    """300 random-but-typed requests: every answer is 200 or a 4xx in OpenAI's shape (no
    5xx), the engine never stops, then /health is 200 and the next request is served."""
    rng = random.Random(37)
    failures = server.worker.failures
    seen: dict[int, int] = {}
    t0 = time.monotonic()
    for i in range(300):
        route, body = _fuzz_request(rng)
        data = json.dumps(body).encode()  # lone surrogates go out as \ud800 escapes
        status, got = _post(server, route, data)
        seen[status] = seen.get(status, 0) + 1
        assert status == 200 or 400 <= status < 500, (i, body, got)
        if status != 200:
            _is_openai_error(got, status)
        assert time.monotonic() - t0 < 120, "the fuzz test is bounded at 120 s"
    assert seen.get(200, 0) > 30 and sum(v for k, v in seen.items() if k >= 400) > 20, seen
    assert server.worker.alive and server.worker.failures == failures, "a fuzz request reached a failing step"
    _served(server)


def test_a_chat_request_without_max_tokens_is_logged(server, caplog):
    """Issue 37: on a CPU the default (the rest of the context) looked like a hang."""
    import logging
    with caplog.at_level(logging.INFO, logger="rlfuse.serve.app"):
        status, body = _post(server, "/v1/chat/completions", {"model": NAME, "temperature": 0,
                                                               "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    assert any("without max_tokens: up to" in r.getMessage() for r in caplog.records)


def test_a_failing_request_fails_alone(server, monkeypatch):
    """A step fails whenever one request (prompt with '~') is in the engine: the requests
    beside it re-run one at a time and are answered (the non-streamed one exactly as without
    the failure, greedy), the culprit alone gets a 500, and the server goes on."""
    import concurrent.futures
    import time

    llm = server.llm
    mark = set(llm.tokenizer.encode("~"))
    good = {"model": NAME, "prompt": "abc", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    _, want = _post(server, "/v1/completions", good)
    real = llm.step

    def step():
        for seqs in list(llm._requests.values()):
            if any(mark & set(s.token_ids[:s.num_prompt_tokens]) for s in seqs):
                raise RuntimeError("injected: the culprit is in this step")
        return real()
    monkeypatch.setattr(llm, "step", step)
    before = server.worker.failures
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        plain = pool.submit(_post, server, "/v1/completions", good)
        streamed = pool.submit(_post, server, "/v1/completions", {**good, "stream": True})
        time.sleep(0.3)  # the good ones are running when the culprit arrives
        bad = pool.submit(_post, server, "/v1/completions", {**good, "prompt": "a~b"})
        (s1, b1), (s2, b2), (s3, b3) = plain.result(60), streamed.result(60), bad.result(60)
    assert s3 == 500 and "injected" in b3["error"]["message"], b3
    assert s1 == 200 and b1["choices"][0]["text"] == want["choices"][0]["text"], b1
    assert s2 == 200 and "[DONE]" in b2 and '"finish_reason": "length"' in b2, b2
    assert server.worker.failures >= before + 2 and server.worker.alive  # the batch's and the culprit's solo run
    monkeypatch.setattr(llm, "step", real)
    _served(server)
