"""Shared by the multi-turn rollout tests: chat tokenizers of three families (byte-level BPE
built here, tool-use templates from chat_templates) and a scripted policy that stands in for
the engine (its streaming API) and answers each turn from a script, as canonical token ids."""

from __future__ import annotations

import time

import torch
from chat_templates import LLAMA31_TOOLS, QWEN3_THINK, QWEN25_TOOLS, bpe_backend

from rlfuse.engine.sequence import Completion
from rlfuse.model.tokenizer import Tokenizer

CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
          "</tool_response>", "<think>", "</think>"]
LLAMA = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
CORPUS = ["What is 12 * 34? Use the calculator.", '{"name": "calculator", "arguments": {"expression": "12*34"}}',
          "The answer is 408.", "You are a helpful assistant.", "I should multiply the numbers first.",
          "def f(x):\n    return x * 2", "Environment: ipython\n\nparameters"] * 4
TEMPLATES = {"qwen2": QWEN25_TOOLS, "qwen3": QWEN3_THINK, "llama": LLAMA31_TOOLS}


def chat_tokenizer(family: str, template: str | None = None) -> Tokenizer:
    if family == "llama":
        return Tokenizer(bpe_backend(LLAMA, CORPUS), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                         chat_template=template or TEMPLATES[family])
    return Tokenizer(bpe_backend(CHATML, CORPUS), eos_token="<|im_end|>", pad_token="<|endoftext|>",
                     chat_template=template or TEMPLATES[family])


class ScriptedEngine:
    """The engine's streaming API driven by `policy(prompt_ids, turn_index) -> text`: each
    request completes with encode(text) + EOS (finish "stop"), or is cut at max_tokens
    (finish "length"). Records every request's prompt ids. Completes one request per step,
    newest first, so requests finish out of submission order."""

    adapters: tuple[str, ...] = ()  # the LLM's adapter bank names (serve lists them): none here

    def __init__(self, tokenizer, policy, max_model_len: int = 4096, step_s: float = 0.0):
        self.tok, self.policy, self.max_model_len = tokenizer, policy, max_model_len
        self.step_s = step_s
        self.step_times: list[float] = []
        self.queue: list[tuple[str, list[int], object]] = []
        self.prompts: dict[str, list[int]] = {}
        self.turn: dict[str, int] = {}

    def add_request(self, ids, params, request_id):
        self.queue.append((request_id, list(ids), params))
        self.prompts[request_id] = list(ids)
        return request_id

    def has_unfinished(self):
        return bool(self.queue)

    def step(self):
        if not self.queue:
            return []
        time.sleep(self.step_s)
        self.step_times.append(time.perf_counter())
        rid, ids, params = self.queue.pop()
        episode = rid.split("-")[0]
        k = self.turn.get(episode, 0)
        self.turn[episode] = k + 1
        out = self.tok.encode(self.policy(ids, k), add_special_tokens=False) + [self.tok.eos_token_ids[0]]
        reason = "stop"
        if len(out) > params.max_tokens:
            out, reason = out[:params.max_tokens], "length"
        lps = -torch.arange(1, len(out) + 1, dtype=torch.float32) / 8  # distinct, recognisable values
        return [Completion(rid, 0, ids, out, lps, reason,
                           self.tok.decode(out, skip_special_tokens=True))]


class WorkerEngine(ScriptedEngine):
    """ScriptedEngine as the serve worker drives it (an AgentSampler's engine: `tokenizer`,
    `abort`, `wake`)."""

    def __init__(self, tok, policy):
        super().__init__(tok, policy)
        self.tokenizer = tok

    def abort(self, rid):
        self.queue = [q for q in self.queue if q[0] != rid]

    def wake(self):
        pass

    def capture_graphs(self, up_to=None):
        pass  # a scripted engine has no decode graphs
