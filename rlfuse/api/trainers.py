"""The Python API's trainers: `SFTTrainer`, `GRPOTrainer`, `PPOTrainer`, `DPOTrainer`.

    from rlfuse import GRPOConfig, GRPOTrainer
    def exact(prompts, completions, answer, **columns):          # TRL's reward signature
        return [float(c.strip() == a) for c, a in zip(completions, answer)]
    trainer = GRPOTrainer("runs/sft", reward_funcs=[exact], train_dataset=rows,
                          args=GRPOConfig(steps=50, group_size=8), run_dir="runs/grpo")
    summary = trainer.train()                      # what `rlfuse grpo` prints its closing lines from
    trainer.generate(["2+3="]); trainer.save("exports/grpo")

A trainer is a run: the constructor resolves the config, takes the run folder (start,
resume or overwrite, as the commands' --resume / --overwrite / --force), opens the session
(data, tokenizer, model) and `train()` runs the same loop as the command. `rlfuse sft` /
`grpo` / `ppo` / `dpo` construct these trainers: one path for both.

  * config: a RunConfig, a dict, a YAML path or a built-in recipe name (api.config); `args`
    replaces the algorithm's section (an SFTConfig / GRPOConfig / PPOConfig / DPOConfig or a
    dict of its fields); `overrides`: "a.b=value" strings as --set.
  * model: a folder (HF, checkpoint or run: `load_model`'s forms), a CausalLM with its
    `tokenizer=`, or an earlier trainer, whose model, tokenizer and engine are taken over
    (SFT then GRPO on one copy of the weights), and its config too when `config` is None;
    None: the config's model section.
  * train_dataset / eval_dataset: a path (data.train / data.eval), a list of dicts, or
    anything with `to_list()` (a `datasets.Dataset`). Rows in memory are written to
    RUN_DIR/data/<split>.jsonl and read back like a file, so the run folder's config.yaml
    names data that `rlfuse eval` and --resume can read.
  * reward_funcs: callables with TRL's signature, built-in names, "file.py:fn" strings or
    {name, weight, kwargs} dicts; reward_weights: one weight per function. A function
    importable by module and name is recorded as "module:function"; others (lambdas,
    functions of a notebook or __main__) as "python:<name>", which only this process can
    resolve.
  * tools (or config rollout.tools): built-in names, "file.py:fn" strings or typed functions
    (recorded as "python:<name>", resolved in this process, like reward functions).
Test: python -m pytest -q tests/test_api.py
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import yaml

from rlfuse.api.config import load_run_config
from rlfuse.api.models import resolve_model_folder
from rlfuse.engine import SamplingParams
from rlfuse.model import CausalLM
from rlfuse.rollout import PYTHON_REWARD, PYTHON_TOOL
from rlfuse.run import RunLock, choose_threads, export_model, prepare_run_folder, set_threads, threads_chosen
from rlfuse.run.config import DPOConfig, GRPOConfig, PPOConfig, RewardSpec, RunConfig, SFTConfig, replace
from rlfuse.run.distributed import DistContext, fail_together, gather_results
from rlfuse.train import Session, open_session, run_dpo, run_grpo, run_ppo, run_sft

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The CLI's log line format (rlfuse.cli uses it too)."""


def log_to_stderr_unless_configured() -> None:
    """The CLI's log output (INFO lines on stderr: evaluations, the closing summary, rows kept
    and dropped) for an API user who configured no logging; a program that did keeps its
    own. Silence it with logging.getLogger("rlfuse").setLevel(logging.WARNING)."""
    pkg = logging.getLogger("rlfuse")
    if logging.getLogger().handlers or pkg.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    pkg.addHandler(handler)
    if pkg.level == logging.NOTSET:
        pkg.setLevel(logging.INFO)
        # as the CLI: the engine's per-call INFO lines would drown the rest
        logging.getLogger("rlfuse.engine").setLevel(logging.WARNING)


def _rows(data, what: str) -> list[dict]:
    if hasattr(data, "to_list"):  # a datasets.Dataset (or anything shaped like one)
        data = data.to_list()
    if not isinstance(data, (list, tuple)) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{what}: expected a path, a list of dicts or a datasets.Dataset, got {type(data).__name__}")
    return list(data)


def _write_rows(rows: list[dict], path: Path, what: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, r in enumerate(rows):
        try:
            lines.append(json.dumps(r, ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}[{i}]: the row cannot be written as JSON ({e}); rows hold strings, numbers, "
                             f"lists and dicts") from None
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _reward_spec(fn, weight: float, i: int) -> tuple[RewardSpec, Callable | None]:
    """(the RewardSpec the config records, the callable if `fn` is one)."""
    if isinstance(fn, RewardSpec):
        return dataclasses.replace(fn, weight=weight) if weight != 1.0 else fn, None
    if isinstance(fn, str):
        return RewardSpec(name=fn, weight=weight), None
    if isinstance(fn, dict):
        return RewardSpec(**{"weight": weight, **fn}), None
    if not callable(fn):
        raise ValueError(f"reward_funcs[{i}]: expected a callable, a reward name or a dict, got {fn!r}")
    name = getattr(fn, "__name__", "") or f"reward_{i}"
    qual, mod = getattr(fn, "__qualname__", ""), getattr(fn, "__module__", None)
    if mod and mod != "__main__" and qual == name and name != "<lambda>":
        return RewardSpec(name=f"{mod}:{name}", weight=weight), fn
    return RewardSpec(name=PYTHON_REWARD + (name if name != "<lambda>" else f"reward_{i}"), weight=weight), fn


def _saved_data(run_dir: Path) -> dict[str, str]:
    """data.train / data.eval as the run folder's config.yaml names them (empty ones left out)."""
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    data = saved.get("data") if isinstance(saved, dict) else None
    return {k: v for k, v in (data or {}).items() if k in ("train", "eval") and isinstance(v, str) and v}


def _tool_functions_out(config):
    """(config without callables in rollout.tools, those entries) for a dict config: a
    RunConfig holds names only, so functions are taken out first and recorded by name."""
    if not isinstance(config, dict) or not isinstance(config.get("rollout"), dict):
        return config, None
    tools = config["rollout"].get("tools")
    if not isinstance(tools, (list, tuple)) or not any(callable(t) for t in tools):
        return config, None
    rollout = {k: v for k, v in config["rollout"].items() if k != "tools"}
    return {**config, "rollout": rollout}, list(tools)


def _tool_spec(t, i: int) -> str:
    """A tool's rollout.tools entry: names and FILE.py:FUNCTION strings as they are, a
    function as python:<name> (resolved in this process only)."""
    if isinstance(t, str):
        return t
    if not callable(t) or getattr(t, "__name__", "<lambda>") == "<lambda>":
        raise ValueError(f"tools[{i}]: expected a built-in name, FILE.py:FUNCTION or a named function (its name "
                         f"and docstring describe it to the model), got {t!r}")
    return PYTHON_TOOL + t.__name__


_CLI_TO_API = (("--resume --force", "resume=True, force=True"), ("pass --force", "pass force=True"),
               ("--resume", "resume=True"), ("--overwrite", "overwrite=True"), ("--force", "force=True"),
               ("another --run-dir", "another run_dir="), ("a new --run-dir", "a new run_dir="),
               ("--run-dir", "run_dir="))


def _api_words(msg: str) -> str:
    """A run-folder message as the Python API's arguments name things (resume=True, not
    --resume): rlfuse.run.folder words them for the command line."""
    for cli, api in _CLI_TO_API:
        msg = msg.replace(cli, api)
    return msg


class _Trainer:
    kind = ""
    """The command and config section: sft, grpo, ppo, dpo."""
    section: type = object
    run: Callable = None
    need_target = False

    def __init__(self, model=None, reward_funcs=None, *, args=None, config: RunConfig | dict | str | None = None,
                 overrides: list[str] = (), train_dataset=None, eval_dataset=None, reward_weights=None,
                 tokenizer=None, run_dir: str | Path | None = None, resume: bool = False, overwrite: bool = False,
                 force: bool = False, dist: DistContext | None = None, tools=None, words: str = "api",
                 sampler_factory=None):
        log_to_stderr_unless_configured()
        if isinstance(model, _Trainer) and config is None:
            # the next stage of the same run: its settings (data formatting and lengths, engine,
            # optimizer, ...) unless a config is given; a GRPO after an SFT on a 64-token model
            # once failed on the default max_prompt_len only after the SFT had run
            config = replace(model.config, **{"checkpoint.resume": "never"})
            inherited = (dict(model.session.reward_functions), dict(model.session.tool_functions))
        else:
            inherited = ({}, {})
        config, in_config = _tool_functions_out(config)
        cfg = load_run_config(config, overrides)
        changes: dict = {}
        if args is not None:
            if not isinstance(args, (self.section, dict)):
                raise ValueError(f"args: expected a {self.section.__name__} (or a dict of its fields), "
                                 f"got {type(args).__name__}")
            # a config object replaces the section (TRL's `args`); a dict changes the fields it names
            changes.update({f"{self.kind}.{k}": v for k, v in args.items()} if isinstance(args, dict) else
                           {self.kind: args})
        if run_dir is not None:
            changes["logging.run_dir"] = str(run_dir)
        if resume and cfg.checkpoint.resume == "never":  # as --resume: from the run folder's latest checkpoint
            changes["checkpoint.resume"] = "auto"
        self._given: dict = {}
        if isinstance(model, _Trainer):  # take over the earlier stage's weights, tokenizer and engine
            prev = model.session
            self._given = dict(model=prev.model, tokenizer=prev.tokenizer, sampler=prev._sampler)
        elif isinstance(model, CausalLM):
            if tokenizer is None:
                raise ValueError("model: a CausalLM needs its tokenizer= (or pass a folder or an earlier trainer)")
            self._given = dict(model=model, tokenizer=tokenizer)
        elif model is not None:
            changes.update({"model.path": str(resolve_model_folder(model, "model")), "model.random_init": None})
        fns: dict[str, Callable] = {} if reward_funcs is not None else inherited[0]
        if reward_funcs is not None:
            funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
            weights = list(reward_weights) if reward_weights is not None else [1.0] * len(funcs)
            if len(weights) != len(funcs):
                raise ValueError(f"reward_weights: {len(weights)} weights for {len(funcs)} reward functions")
            specs = []
            for i, (fn, w) in enumerate(zip(funcs, weights)):
                spec, call = _reward_spec(fn, float(w), i)
                specs.append(spec)
                if call is not None:
                    fns[spec.name] = call
            changes["rewards"] = specs
        tool_fns: dict[str, Callable] = {} if tools is not None or in_config is not None else inherited[1]
        if tools is not None or in_config is not None:
            specs = []
            for i, t in enumerate(list(tools if tools is not None else in_config)):
                spec = _tool_spec(t, i)
                specs.append(spec)
                if callable(t):
                    tool_fns[spec] = t
            changes["rollout.tools"] = specs
        in_memory = {}
        for split, data in (("train", train_dataset), ("eval", eval_dataset)):
            if isinstance(data, (str, Path)):
                changes[f"data.{split}"] = str(data)
            elif data is not None:
                in_memory[split] = _rows(data, f"{split}_dataset")
        run_path = Path(changes.get("logging.run_dir", cfg.logging.run_dir))
        for split in in_memory:
            changes[f"data.{split}"] = str(run_path / "data" / f"{split}.jsonl")
        if resume:  # the run names its own data (rows once in memory: RUN_DIR/data/*.jsonl)
            for split, path in _saved_data(run_path).items():
                if f"data.{split}" not in changes and not getattr(cfg.data, split):
                    changes[f"data.{split}"] = path
        self.config: RunConfig = replace(cfg, **changes) if changes else cfg
        self.dist = dist
        self._lock: RunLock | None = None
        self._words = words  # "cli": the commands construct this trainer; their errors name --resume, ...
        self._prepare(resume, overwrite, force)
        try:
            self._write_datasets(in_memory)
            self.session: Session = open_session(self.config, need_target=self.need_target, dist=dist,
                                                 reward_functions=fns, tool_functions=tool_fns,
                                                 sampler_factory=sampler_factory, **self._given)
        except BaseException:
            self._release()
            raise
        if not threads_chosen() and self.session.device.type == "cpu":  # the commands' --threads, else by size
            set_threads(*choose_threads(sum(p.numel() for p in self.session.model.parameters())))
        self.summary: dict | None = None

    def _write_datasets(self, in_memory: dict) -> None:
        """Rows in memory -> RUN_DIR/data/<split>.jsonl. Data-parallel: rank 0 writes its
        rows and every rank then reads that file, so all ranks hold the same global rows
        whatever each was passed, and each takes its share of every step's batch
        (`local_slice`); a rank 0 error stops every rank."""
        def write():
            if self.dist is None or self.dist.is_main:
                for split, rows in in_memory.items():
                    _write_rows(rows, Path(getattr(self.config.data, split)), f"{split}_dataset")
        if self.dist is None or not in_memory:
            write()
            return
        with fail_together(self.dist, "datasets"):  # also the barrier before the other ranks read
            write()

    def _prepare(self, resume: bool, overwrite: bool, force: bool) -> None:
        """Take the run folder's lock, then start, resume or overwrite it (rlfuse.run.folder).
        Under torchrun rank 0 alone touches it and holds the lock; every rank stops with its
        error if it refuses. The lock is held until `train()` ends."""
        def prepare():
            if self.dist is None or self.dist.is_main:
                try:
                    self._lock = prepare_run_folder(self.config, self.kind, resume=resume, overwrite=overwrite,
                                                    force=force)
                except ValueError as e:
                    if self._words == "cli":
                        raise
                    raise ValueError(_api_words(str(e))) from None
        if self.dist is None:
            prepare()
            return
        try:
            with fail_together(self.dist, "run folder"):
                prepare()
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # ------------------------------------------------------------------ the run
    def train(self) -> dict:
        """Run the algorithm to its configured steps (resuming per the config); returns the
        summary: history (logged rows), evals, steps, run_dir, data (rows kept/dropped)."""
        try:
            res = type(self).run(self.config, session=self.session)
        finally:
            self._release()  # the run folder is free for the next run (a resume too)
        self.summary = {k: v for k, v in res.items() if k not in ("model", "tokenizer")}
        return self.summary

    @property
    def model(self) -> CausalLM:
        """The policy being trained (the same tensors the engine generates from)."""
        return self.session.model

    @property
    def tokenizer(self):
        return self.session.tokenizer

    @property
    def run_dir(self) -> Path:
        return self.session.run_dir

    def save(self, path: str | Path) -> Path:
        """Write the current weights and the tokenizer as an HF folder (what RUN_DIR/final holds)."""
        return export_model(path, self.model, self.tokenizer, dist=self.session.dist)

    def generate(self, prompts: str | list[str], *, chat: bool = False, max_tokens: int = 128,
                 temperature: float = 0.0, n: int = 1, **sampling) -> list[str]:
        """Completions of `prompts` with the run's engine on the current weights (greedy by
        default; other SamplingParams fields as keywords). `chat`: each prompt is a user
        message in the chat template. Returns len(prompts) * n texts, prompt-major.
        Data-parallel (dist=): a collective; every rank calls it with the same prompts and
        gets every text. Rank r generates the r-th of N near-equal contiguous parts of the
        prompts on the gathered weights, then one all-gather (a seeded request samples
        what it samples in one process: the engine keys its draws by seed and prompt)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        tok = self.tokenizer
        ids = [tok.chat_prompt_ids([{"role": "user", "content": p}]) if chat else tok.encode(p) for p in prompts]
        params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, **sampling)
        sampler = self.session.sampler
        ctx = self.session.dist

        def run(part: list) -> list[str]:
            sampler.wake()  # data-parallel: gathers the weights (every rank, even with no prompts)
            try:
                outs = sampler.llm.generate(part, params) if part else []
            finally:
                sampler.sleep()  # the KV pool goes back to training
            return [o.text if o.text is not None else tok.decode(o.output_token_ids, skip_special_tokens=True)
                    for o in outs]
        if ctx is None:
            return run(ids)
        k, w = len(ids), ctx.world_size
        return [t for part in gather_results(ctx, "generate", run, ids[ctx.rank * k // w:(ctx.rank + 1) * k // w])
                for t in part]


class SFTTrainer(_Trainer):
    """Supervised fine-tuning (`rlfuse sft`): rows with prompt + completion, or messages."""
    kind, section, run, need_target = "sft", SFTConfig, staticmethod(run_sft), True


class GRPOTrainer(_Trainer):
    """GRPO and its variants (`rlfuse grpo`): prompts, reward functions."""
    kind, section, run = "grpo", GRPOConfig, staticmethod(run_grpo)


class PPOTrainer(_Trainer):
    """PPO with a critic (`rlfuse ppo`): prompts, reward functions."""
    kind, section, run = "ppo", PPOConfig, staticmethod(run_ppo)


class DPOTrainer(_Trainer):
    """DPO / IPO / conservative DPO (`rlfuse dpo`): preference rows (prompt, chosen, rejected)."""
    kind, section, run = "dpo", DPOConfig, staticmethod(run_dpo)
