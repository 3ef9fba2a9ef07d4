"""Run infrastructure that knows no algorithm: configuration, building the model and
engine, checkpoints and resume, the run folder, metrics, the optimizer, packed batches
the distributed plumbing and the opt-in step profiler (profile). `rlfuse.run.report` (plots; imports matplotlib) is imported
by module where a report is written."""

from rlfuse.run.batching import PackedBatch, pack_by_tokens, share_plan, shared_contexts
from rlfuse.run.build import (
                              apply_lora,
                              build_engine,
                              build_model,
                              build_sharded,
                              build_tokenizer,
                              char_tokenizer,
                              check_model_folder,
                              check_vocab,
                              choose_threads,
                              pick_device,
                              seed_everything,
                              set_threads,
                              threads_chosen,
)
from rlfuse.run.checkpoint import export_model, list_checkpoints, merged_folder, save_checkpoint, save_final
from rlfuse.run.distributed.replicated import ReplicatedAdamW, log_replicated_memory
from rlfuse.run.folder import RunLock, clear_run, make_folder, prepare_run_folder, remove_path
from rlfuse.run.interrupt import Interrupted, stop_agreed, stop_on_signals
from rlfuse.run.metrics import DATA_REASONS, DATA_STAGE, PhaseTimer, RunLog, data_lines, peak_memory_mb, read_jsonl
from rlfuse.run.optim import MasterAdamW, NonFiniteGuard, WeightNormWatch, clip_grad_norm_, lr_at
from rlfuse.run.profile import StepProfiler, step_profiler
from rlfuse.run.resume import load_checkpoint, load_model_folder, model_folder, resolve_resume
from rlfuse.run.trackers import open_trackers
from rlfuse.utils.user_code import load_function

__all__ = ["DATA_REASONS", "DATA_STAGE", "Interrupted", "MasterAdamW", "NonFiniteGuard", "PackedBatch", "PhaseTimer",
           "ReplicatedAdamW", "RunLock", "RunLog", "StepProfiler", "WeightNormWatch", "apply_lora", "build_engine", "build_model", "build_sharded",
           "build_tokenizer",
           "char_tokenizer", "check_model_folder", "check_vocab", "choose_threads", "clear_run", "clip_grad_norm_", "data_lines",
           "export_model", "list_checkpoints", "load_checkpoint", "log_replicated_memory", "load_function", "load_model_folder", "lr_at",
           "make_folder", "merged_folder", "model_folder", "open_trackers", "pack_by_tokens", "peak_memory_mb",
           "pick_device", "prepare_run_folder", "share_plan", "shared_contexts",
           "read_jsonl", "remove_path", "resolve_resume", "save_checkpoint", "save_final", "seed_everything",
           "set_threads", "step_profiler", "stop_agreed", "stop_on_signals", "threads_chosen"]
