"""Data-parallel plumbing on PyTorch's own stack: the process group and cross-rank
helpers (context), FSDP2 sharding (fsdp), models built on the meta device shard by shard
(build), DCP checkpoint I/O (dcp), and how the trainers split rollouts, micro-batches and
evaluation over ranks (data_parallel). Replicated models (LoRA: gradients all-reduced, no
sharding) are in replicated.py, exported by rlfuse.run (it subclasses rlfuse.run.optim's
MasterAdamW, which imports this package)."""

from rlfuse.run.distributed.context import (
                                            DistContext,
                                            LaunchEnv,
                                            RankFailed,
                                            fail_together,
                                            gather_results,
                                            global_sums,
                                            init_distributed,
                                            launch_env,
                                            local_slice,
                                            max_across_ranks,
                                            mean_across_ranks,
                                            on_any_rank,
                                            on_main,
                                            quiet_non_main,
                                            reduce_metrics,
                                            shutdown,
)
from rlfuse.run.distributed.data_parallel import (
                                            GatheredSampler,
                                            SilentLog,
                                            episode_metrics_on_ranks,
                                            evaluate_on_ranks,
                                            local_micro_batches,
                                            reduce_mismatch,
                                            reduce_routing_mismatch,
                                            rollout_on_ranks,
                                            step_metrics,
)
from rlfuse.run.distributed.dcp import full_adamw_state, load_full_adamw_state
from rlfuse.run.distributed.fsdp import (
                                            ShardedAdamW,
                                            configure_fsdp,
                                            full_copy,
                                            gathered_weights,
                                            is_sharded,
                                            local_gradients,
                                            log_memory,
                                            reduce_local_gradients,
                                            reshard,
                                            shard_model,
                                            sync_on_last,
)

__all__ = ["DistContext", "GatheredSampler", "LaunchEnv", "RankFailed", "ShardedAdamW", "SilentLog", "configure_fsdp", "episode_metrics_on_ranks",
           "evaluate_on_ranks",
           "fail_together", "full_adamw_state", "full_copy", "gather_results", "gathered_weights", "global_sums", "init_distributed",
           "is_sharded", "launch_env", "load_full_adamw_state", "local_gradients", "local_micro_batches", "local_slice", "log_memory", "max_across_ranks",
           "mean_across_ranks", "on_any_rank", "on_main", "quiet_non_main", "reduce_local_gradients", "reduce_metrics", "reduce_mismatch",
           "reduce_routing_mismatch", "reshard", "rollout_on_ranks",
           "shard_model", "shutdown", "step_metrics", "sync_on_last"]
