"""`rlfuse serve`: the OpenAI-compatible server on the engine, driven by the official
`openai` client against a tiny random model on 127.0.0.1 (tests/serve_helpers.py).

Greedy completions equal the naive oracle; streamed deltas add up to the non-streamed
answer (same seed); chat prompts are the ones `rlfuse generate --chat` builds; bad requests
are 4xx in OpenAI's shape; 32 concurrent streams through a KV pool that holds ~8 of them
all finish whole (requests wait, none is dropped); a client that disconnects mid-stream
has its sequence aborted and its KV blocks freed."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from engine_helpers import one_thread  # noqa: F401,E402 (fixture)
from serve_helpers import EOS, LocalServer, byte_tokenizer, write_model_folder  # noqa: E402

from rlfuse.api import load_model  # noqa: E402
from rlfuse.cli import main  # noqa: E402
from rlfuse.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from rlfuse.engine.naive import greedy_generate_naive  # noqa: E402
from rlfuse.serve import build_app  # noqa: E402
from rlfuse.serve.detokenize import IncrementalText  # noqa: E402

NAME = "tiny"
KV_BLOCKS = 16  # x 16 tokens: ~8 of the concurrent test's sequences (prompt + 12 new tokens) at a time


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("serve_model"))


@pytest.fixture(scope="module")
def server(folder):
    model, tok = load_model(folder, device="cpu")
    llm = LLM(model, tok, EngineConfig(max_model_len=160, max_num_seqs=32, num_kv_blocks=KV_BLOCKS))
    with LocalServer(build_app(llm, NAME)) as s:
        s.llm = llm
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _http(server, path: str, body: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _health(server) -> dict:
    status, body = _http(server, "/health")
    assert status == 200, body
    return body


def _wait_idle(server, seconds: float = 20.0) -> dict:
    for _ in range(int(seconds / 0.05)):  # bounded
        h = _health(server)
        if h["requests"] == 0 and h["running"] == 0 and h["waiting"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle in {seconds} s: {h}")


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    h = _health(server)
    assert h["status"] == "ok" and h["total_blocks"] == KV_BLOCKS


def test_greedy_completion_equals_oracle(server, client, folder):
    tok = byte_tokenizer()
    prompts = ["Hello", "2+2="]
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0, logprobs=0,
                                  extra_body={"return_token_ids": True})
    ref_model, _ = load_model(folder, device="cpu")
    refs = greedy_generate_naive(ref_model, [tok.encode(p) for p in prompts], 8, eos_ids=[EOS])
    assert [c.index for c in r.choices] == [0, 1]
    for c, p, ref in zip(r.choices, prompts, refs):
        d = c.model_dump()
        assert d["prompt_token_ids"] == tok.encode(p) and d["token_ids"] == ref
        assert c.text == tok.decode(ref, skip_special_tokens=True)
        assert c.finish_reason == ("stop" if ref[-1] == EOS else "length")
        assert len(c.logprobs.token_logprobs) == len(ref) and all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert r.usage.completion_tokens == sum(len(x) for x in refs)
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)


def _streamed(chunks, chat: bool) -> tuple[dict, dict]:
    texts, finish = {}, {}
    for ch in chunks:
        for c in ch.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_adds_up_to_the_answer(client, chat):
    kw = dict(model=NAME, n=2, temperature=1.0, top_p=0.9, seed=7, max_tokens=12, extra_body={"top_k": 50})
    if chat:
        create, kw["messages"] = client.chat.completions.create, [{"role": "user", "content": "Say hi"}]
    else:
        create, kw["prompt"] = client.completions.create, "Once upon"
    whole = create(**kw)
    texts, finish = _streamed(create(stream=True, **kw), chat)
    want = {c.index: (c.message.content if chat else c.text) for c in whole.choices}
    assert len(want) == 2 and texts == want and all(len(t) > 0 for t in want.values())
    assert finish == {c.index: c.finish_reason for c in whole.choices}


def test_stop_string_streamed_and_not(client):
    base = client.completions.create(model=NAME, prompt="abc", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) >= 6
    stop = base[3:5]
    cut = base[:base.index(stop)]
    kw = dict(model=NAME, prompt="abc", max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    one = client.completions.create(**kw).choices[0]
    assert (one.text, one.finish_reason) == (cut, "stop")
    assert _streamed(client.completions.create(stream=True, **kw), False) == ({0: cut}, {0: "stop"})


def test_chat_template_parity_with_generate_cli(client, folder, capsys):
    q = "What is 2+2?"
    rc = main(["--log-level", "WARNING", "generate", str(folder), "--chat", "--prompt", q, "--max-tokens", "10",
               "--json", "--device", "cpu", "--max-model-len", "160"])
    assert rc == 0
    (line,) = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": q}], max_tokens=10,
                                       temperature=0, extra_body={"return_token_ids": True})
    c = r.choices[0].model_dump()
    assert c["prompt_token_ids"] == byte_tokenizer().chat_prompt_ids([{"role": "user", "content": q}])
    assert c["token_ids"] == line["output_token_ids"]
    assert c["message"]["content"] == line["text"] and c["finish_reason"] == line["finish_reason"]


@pytest.mark.parametrize("kw,status,param", [
    (dict(prompt="x", temperature=-1), 400, "temperature"),
    (dict(prompt="x", extra_body={"bogus": 1}), 400, "bogus"),
    (dict(prompt="x", logprobs=3), 400, "logprobs"),
    (dict(prompt="x", presence_penalty=0.5), 400, "presence_penalty"),
    (dict(prompt="x", model="other"), 404, "model"),
    (dict(prompt="x" * 200), 400, "prompt"),
    (dict(prompt=[[5, 9999]]), 400, "prompt"),
    (dict(prompt="x", max_tokens=0), 400, "max_tokens"),
    (dict(messages=[]), 400, "messages"),
    (dict(messages=[{"role": "user", "content": "x"}], top_logprobs=2, logprobs=True), 400, "top_logprobs"),
    (dict(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {"name": "f"}}]),
     400, "tools"),
], ids=["temperature", "unknown-field", "top-logprobs", "penalty", "model", "too-long", "bad-id", "max-tokens-0",
        "no-messages", "chat-top-logprobs", "tools"])
def test_bad_requests_are_4xx_in_openai_shape(client, kw, status, param):
    kw = {"model": NAME, **kw}
    create = client.chat.completions.create if "messages" in kw else client.completions.create
    with pytest.raises(openai.APIStatusError) as e:
        create(**kw)
    assert e.value.status_code == status
    err = e.value.body
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert param in (err["param"] or "") or param in err["message"]


def test_invalid_json_and_unknown_route(server):
    status, body = _http(server, "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["message"]
    status, body = _http(server, "/v1/nothing")
    assert status == 404 and body["error"]["message"]


def test_32_concurrent_streams_nothing_lost(server):
    """32 streaming clients at once; the pool holds ~8 sequences, so most requests wait
    (seen through /health). Every stream ends whole and equals its non-streamed answer."""
    n_clients, max_tokens = 32, 12
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    kws = [dict(model=NAME, prompt=f"client {i}:", max_tokens=max_tokens, temperature=1.0, seed=i,
                extra_body={"ignore_eos": True, "return_token_ids": True}) for i in range(n_clients)]
    waiting_seen = []

    async def one_stream(kw):
        ids, text = [], ""
        async for ch in await aclient.completions.create(stream=True, **kw):
            for c in ch.choices:
                ids += c.model_dump().get("token_ids") or []
                text += c.text
        return ids, text

    async def watch(task):
        while not task.done():
            h = await asyncio.to_thread(_health, server)
            waiting_seen.append(h["waiting"])
            await asyncio.sleep(0.02)

    async def run():
        streams = asyncio.gather(*(one_stream(kw) for kw in kws))
        await asyncio.gather(streams, watch(streams))
        return streams.result()

    got = asyncio.run(run())
    assert max(waiting_seen) > 0, "the pool never filled: the test does not exercise queueing"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    for kw, (ids, text) in zip(kws, got):
        assert len(ids) == max_tokens
        whole = client.completions.create(**kw).choices[0]
        assert (whole.model_dump()["token_ids"], whole.text) == (ids, text)
    h = _wait_idle(server)
    assert h["free_blocks"] == h["total_blocks"]


def test_disconnect_frees_its_sequence(server, client):
    _wait_idle(server)
    before = server.llm.stats.output_tokens
    stream = client.completions.create(model=NAME, prompt="long", max_tokens=150, temperature=1.0, seed=3,
                                       stream=True, extra_body={"ignore_eos": True})
    for got, _ in enumerate(stream, 1):
        if got == 3:  # a few chunks in: the client goes away
            break
    stream.close()
    h = _wait_idle(server)
    assert h["free_blocks"] == h["total_blocks"]
    assert server.llm.stats.output_tokens - before < 150, "the sequence ran to the end: the abort did not happen"


@pytest.mark.parametrize("stop", [(), ("ab", "xyz")])
def test_detokenize_deltas_add_up(stop):
    """Random byte ids (invalid UTF-8 included) in random chunks: the deltas plus `finish`
    equal the full decode; with stop strings nothing is sent that a stop could still cut."""
    tok = byte_tokenizer()
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.choice([rng.randrange(32, 127), rng.randrange(0, 256)]) for _ in range(rng.randrange(1, 40))]
        inc, sent, i = IncrementalText(tok, stop=stop), "", 0
        while i < len(ids):
            k = rng.randrange(1, 4)
            sent += inc.add(ids[i:i + k])
            full = tok.decode(ids[:i + k])
            assert full.startswith(sent)
            if stop:
                assert len(full) - len(sent) >= min(len(full), 2) or "\ufffd" in full[len(sent):]
            i += k
        text = tok.decode(ids)
        assert sent + inc.finish(text) == text


def test_without_the_serve_extra_the_command_says_which(folder, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed: importing it raises ImportError
    assert main(["serve", str(folder)]) == 2
    assert "rlfuse serve needs the serve extra (uvicorn is not installed)" in capsys.readouterr().err


def test_adapter_is_applied_unmerged(folder, tmp_path, capsys, monkeypatch):
    """--adapter loads a PEFT folder onto MODEL (as generate --adapter); a missing one is an
    error naming it. uvicorn.run is stubbed: the app it would serve is inspected."""
    import uvicorn

    from rlfuse.api import load_model
    from rlfuse.model.lora import LoRAConfig, attach_lora, has_lora, init_lora_
    from rlfuse.model.lora_peft import save_peft_adapter

    assert main(["serve", str(folder), "--adapter", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    assert "nope" in capsys.readouterr().err
    model, _ = load_model(str(folder), device="cpu")
    attach_lora(model, LoRAConfig(rank=2, alpha=4.0))
    init_lora_(model, seed=1, b_std=0.05)
    save_peft_adapter(model, tmp_path / "adapter")
    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app))
    assert main(["serve", str(folder), "--adapter", str(tmp_path / "adapter"), "--device", "cpu",
                 "--max-model-len", "64", "--max-num-seqs", "4"]) == 0
    llm = served["app"].state.serve.worker.llm
    assert has_lora(llm.model)
    for (n, p), (n2, q) in zip(sorted(llm.model.state_dict().items()), sorted(model.state_dict().items())):
        assert n == n2 and torch.equal(p, q), n


def test_several_adapters_in_one_server(folder, tmp_path, monkeypatch):
    """--lora a=PATH b=PATH: /v1/models lists the model and both adapters; concurrent
    requests naming each (sharing batches) get, bitwise in exact numerics, the tokens and
    log-probs of an engine over a model holding that adapter alone (or none)."""
    from concurrent.futures import ThreadPoolExecutor

    import uvicorn

    from rlfuse.model.lora import LoRAConfig, attach_lora, init_lora_
    from rlfuse.model.lora_peft import load_peft_adapter, save_peft_adapter

    for i, name in enumerate(("a", "b")):
        m, _ = load_model(str(folder), device="cpu")
        attach_lora(m, LoRAConfig(rank=2, alpha=2.0 * (i + 1)))
        init_lora_(m, seed=i, b_std=0.5)
        save_peft_adapter(m, tmp_path / name)
    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app))
    engine = ["--device", "cpu", "--max-model-len", "64", "--max-num-seqs", "8", "--numerics", "exact"]
    assert main(["serve", str(folder), "--served-model-name", NAME, "--lora", f"a={tmp_path / 'a'}",
                 f"b={tmp_path / 'b'}", *engine]) == 0
    assert main(["serve", str(folder), "--lora", "a"]) == 2  # NAME=PATH expected
    prompts = ["Hello", "2+2=", "Hi there"]
    with LocalServer(served["app"]) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [NAME, "a", "b"]

        def ask(model):
            r = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, logprobs=0,
                                          extra_body={"return_token_ids": True})
            assert r.model == model
            return [(c.model_dump()["token_ids"], c.logprobs.token_logprobs) for c in r.choices]

        with ThreadPoolExecutor(3) as pool:
            got = dict(zip((NAME, "a", "b"), pool.map(ask, (NAME, "a", "b"))))
        with pytest.raises(openai.NotFoundError, match="'tiny', 'a', 'b'"):
            client.completions.create(model="c", prompt="x", max_tokens=1)
    tok = byte_tokenizer()
    for name in (NAME, "a", "b"):
        m, _ = load_model(str(folder), device="cpu")
        if name != NAME:
            load_peft_adapter(m, tmp_path / name)
        llm = LLM(m, tok, EngineConfig(max_model_len=64, max_num_seqs=8, numerics="exact"))
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
        assert got[name] == [(list(o.output_token_ids), o.logprobs.tolist()) for o in outs], name
    assert got["a"] != got[NAME] and got["b"] != got["a"]


def test_serve_command(folder):
    """`rlfuse serve` as a user starts it (exact numerics): a subprocess on a free port, the
    model list, one completion."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "rlfuse", "serve", str(folder), "--port", str(port), "--device", "cpu",
           "--max-model-len", "64", "--max-num-seqs", "4", "--numerics", "exact"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
        for _ in range(600):  # bounded: 60 s
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.1)
        else:
            raise AssertionError("rlfuse serve did not answer in 60 s")
        assert [m.id for m in models.data] == [folder.name]
        r = client.completions.create(model=folder.name, prompt="Hi", max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(30)
