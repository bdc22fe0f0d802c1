"""Writes docs/reference/config.md from zcore's config schema.

Every key of ``zcore.config.Config`` (zcore.config.schema, section.py and
optimizer.py), walked from the pydantic models themselves: its type and
bounds, its default, DeepSpeed's name for it and what zcore does with it;
then the DeepSpeed keys zcore does not implement (zcore.config.keys), with
the value at which each is still accepted and the reason.

A key's text is its field's ``description`` when the schema gives one, else
the entry for its class and field in DESCRIPTIONS below. A key with neither,
or an entry for a key the schema no longer has, is an error, so the page
cannot drift from the schema: tests/python/test_docs.py regenerates it and
compares.

    python scripts/gen_config_reference.py           # write the page
    python scripts/gen_config_reference.py --check   # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from zcore.config import keys as config_keys
from zcore.config.schema import Config

OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "reference" / "config.md"

# What zcore does with each key, by the class that declares the field (a
# subclass inherits its base's entry unless it has its own).
DESCRIPTIONS: dict[str, str] = {
    # Top level.
    "Config.train_batch_size": (
        "Samples per optimizer step over all data-parallel ranks: micro-batch x accumulation steps x "
        'data-parallel size. Any one of the three batch keys may be left out (or `"auto"`) and is inferred; '
        "given all three, they must agree."
    ),
    "Config.train_micro_batch_size_per_gpu": (
        "Samples per rank in one forward and backward. Sets the batch size of the data loader that "
        "`zcore.initialize(training_data=...)` returns."
    ),
    "Config.gradient_accumulation_steps": (
        "Micro-batches whose gradients are summed before each optimizer step; `engine.backward` divides the "
        "loss by it. Inferred as 1 when neither it nor `train_batch_size` is given."
    ),
    "Config.gradient_clipping": (
        "Clips the global gradient norm (over every rank's shards, every stage and tensor-parallel slice) to "
        "this value before each step; 0 turns clipping off."
    ),
    "Config.communication_data_type": (
        "The dtype gradients are reduced in across ranks. Unset, zcore reduces in fp32 whatever the compute "
        "dtype: summing low-precision gradients over many ranks loses bits or overflows."
    ),
    "Config.steps_per_print": (
        "Every this many optimizer steps, rank 0 prints DeepSpeed's progress line (`step=N, skipped=K, "
        "lr=[...], mom=[...]`: skipped steps count, the lr is the next step's), and with "
        "`wall_clock_breakdown` the step's time split: to stderr, or through your logging where it handles "
        "the logger `zcore.steps` (INFO)."
    ),
    "Config.wall_clock_breakdown": (
        "Records each step's metrics (as the monitors do) and prints the time split on rank 0 every "
        "`steps_per_print` steps."
    ),
    "Config.dataloader_drop_last": (
        "The data loader `zcore.initialize(training_data=...)` returns drops each rank's last micro-batch "
        "when it is incomplete, as DeepSpeed's does; its DistributedSampler still pads the ranks to equal "
        "lengths."
    ),
    "Config.zero_allow_untested_optimizer": (
        "Accepts a torch optimizer that zcore does not know to update element-wise at stages 1-3, where it "
        "steps slices of parameters. Set it only for an optimizer whose update is element-wise."
    ),
    # optimizer
    "AdamOptimizerConfig.type": (
        "`Adam` or `AdamW`, in any case. Other types are refused: pass a torch optimizer (or a callable "
        "building one) to `zcore.initialize(optimizer=...)` instead."
    ),
    "_AdamHyperParams.lr": "Learning rate (a schedule may change it every step).",
    "_AdamHyperParams.betas": (
        "Adam's coefficients for the running averages of the gradient and its square, each in [0, 1)."
    ),
    "_AdamHyperParams.eps": "Added to the denominator for numerical stability.",
    "_AdamHyperParams.weight_decay": (
        "Weight decay: decoupled (AdamW) or an L2 penalty, as `type` and `adam_w_mode` say."
    ),
    "AdamParams.adam_w_mode": (
        "For type `Adam`: decoupled weight decay (AdamW), DeepSpeed's default; false gives torch.optim.Adam's "
        "L2 penalty. Type `AdamW` is always decoupled."
    ),
    "AdamParams.bias_correction": (
        "DeepSpeed's fused and CPU Adam take it; zcore's Adam always corrects the moments' bias, so only "
        "`true` is accepted."
    ),
    "AdamParams.fp32_optimizer_states": (
        "DeepSpeed's CPU Adam takes it; zcore keeps Adam's states in fp32, so only `true` is accepted."
    ),
    "AdamParams.torch_adam": (
        "Steps with torch's Adam/AdamW instead of zcore's fused CPU Adam when the optimizer states are in "
        "host memory. Refused with the states on NVMe, which only the fused CPU Adam streams."
    ),
    "AdamParams.amsgrad": "AMSGrad is not implemented: only false is accepted.",
    "OneBitAdamConfig.type": "`OneBitAdam`: DeepSpeed's 1-bit Adam, at ZeRO stage 0 only, without optimizer offload.",
    "ZeroOneAdamConfig.type": "`ZeroOneAdam`: DeepSpeed's 0/1 Adam, at ZeRO stage 0 only, without optimizer offload.",
    "_CompressedAdamParams.bias_correction": (
        "Taken as DeepSpeed takes it, and never applied, as in DeepSpeed: these optimizers run Adam without "
        "bias correction."
    ),
    "_CompressedAdamParams.eps_inside_sqrt": (
        "Only false: eps is always added outside the square root, as in DeepSpeed."
    ),
    "_CompressedAdamParams.max_grad_norm": (
        "Only 0: DeepSpeed keeps it and never clips with it. Clip with the top-level `gradient_clipping`."
    ),
    "_CompressedAdamParams.amsgrad": "Only false.",
    "_CompressedAdamParams.weight_decay": "Decoupled weight decay (as AdamW), as in DeepSpeed.",
    "_CompressedAdamParams.cuda_aware": (
        "Only false: it tells DeepSpeed's MPI implementation that MPI reads GPU memory, and zcore has no MPI "
        "implementation."
    ),
    "_CompressedAdamParams.comm_backend_name": (
        "DeepSpeed's choice of compressed all-reduce. zcore sends the same 1-bit messages through "
        "torch.distributed whatever it says: `nccl`, `gloo` and `compressed` are accepted; `mpi` and `hccl` "
        "are refused."
    ),
    "OneBitAdamParams.freeze_step": (
        "Exact Adam steps (the warm-up) before the variance is frozen and the momentum is averaged in 1-bit "
        "messages with error feedback; at least 1."
    ),
    "ZeroOneAdamParams.var_freeze_step": (
        "The variance is updated at exponentially spaced steps until this step (the last update comes at "
        "`var_freeze_step + 1` at the latest); the gradients between are sent compressed."
    ),
    "ZeroOneAdamParams.var_update_scaler": "Variance updates per interval before the interval between them doubles.",
    "ZeroOneAdamParams.local_step_scaler": (
        "After the variance freezes: local steps per synchronisation interval before the interval doubles."
    ),
    "ZeroOneAdamParams.local_step_clipper": "The longest synchronisation interval, in steps.",
    "MuonConfig.type": (
        "`Muon`: torch.optim.Muon's update for the parameters of two or more dimensions whose names hold neither "
        "`embed` nor `lm_head` (a `use_muon` attribute set on a parameter decides instead), AdamW for the others, "
        "as DeepSpeed splits them; each matrix is stepped whole by one rank (owner compute). Stages 0 to 3, the "
        "optimizer on the device or the host; not on NVMe, nor with tensor or pipeline parallelism, yet."
    ),
    "MuonParams.lr": "Learning rate of both halves, unless `muon_lr` or `adam_lr` sets one (DeepSpeed: 0.02 and 3e-4).",
    "MuonParams.muon_lr": "Muon's learning rate, before torch's adjustment for the matrix's shape.",
    "MuonParams.adam_lr": "AdamW's learning rate.",
    "MuonParams.momentum": "Muon's momentum, with Nesterov's blend, as torch.optim.Muon.",
    "MuonParams.weight_decay": "Decoupled weight decay of both halves.",
    "MuonParams.betas": "AdamW's coefficients for the running averages of the gradient and its square.",
    "MuonParams.eps": "AdamW's term added to the denominator.",
    "MuonParams.ns_method": (
        "`standard`: torch.optim.Muon's quintic Newton-Schulz iteration in bfloat16. `gram`: DeepSpeed's "
        "Gram Newton-Schulz in fp16, with DeepSpeed's numerics; under ZeRO it exchanges matrices in fp32, twice "
        "standard's bytes. DeepSpeed's default is `gram`, zcore's `standard`."
    ),
    "MuonParams.adam_w_mode": "Only true: the AdamW half decays weights decoupled, as DeepSpeed's default.",
    "MuonParams.torch_adam": "Accepted: DeepSpeed's choice of AdamW kernel; zcore's AdamW half is torch's math.",
    "MuonParams.foreach": "Accepted: DeepSpeed passes it to torch's AdamW; zcore chooses its own kernel.",
    "MuonParams.fp32_optimizer_states": "Only true: the AdamW half keeps its states in fp32.",
    "MuonParams.per_head_muon": (
        "Only false: zcore orthogonalises each matrix whole (torch.optim.Muon); DeepSpeed's per-head "
        "orthogonalisation of attention projections is refused."
    ),
    # scheduler
    "WarmupLRScheduler.type": "`WarmupLR`: warm up from `warmup_min_lr` to `warmup_max_lr`, then hold.",
    "WarmupDecayLRScheduler.type": "`WarmupDecayLR`: WarmupLR's warm-up, then linear decay to 0 at `total_num_steps`.",
    "WarmupCosineLRScheduler.type": (
        "`WarmupCosineLR`: a ratio of each group's initial learning rate, warmed up from `warmup_min_ratio` "
        "to 1, then decayed along a cosine to `cos_min_ratio` at `total_num_steps`."
    ),
    "WarmupLRParams.warmup_min_lr": "Learning rate at the start of the warm-up.",
    "WarmupLRParams.warmup_max_lr": "Learning rate at the end of the warm-up; null takes the optimizer's `lr`.",
    "WarmupDecayLRParams.warmup_max_lr": "Learning rate at the end of the warm-up, where the decay starts.",
    "WarmupLRParams.warmup_num_steps": "Optimizer steps of the warm-up (at least 2 are used, as in DeepSpeed).",
    "WarmupLRParams.warmup_type": "`log`: the warm-up rises with log(step); `linear`: in proportion to the step.",
    "WarmupLRParams.last_batch_iteration": (
        "The step the schedule starts after; -1 starts at the beginning. A loaded checkpoint restores the "
        "schedule's own position."
    ),
    "WarmupDecayLRParams.total_num_steps": "Optimizer steps after which the learning rate is 0. Required.",
    "WarmupCosineLRParams.total_num_steps": "Optimizer steps at whose end the ratio reaches `cos_min_ratio`. Required.",
    "WarmupCosineLRParams.warmup_min_ratio": "Ratio of the initial learning rate at the start of the warm-up.",
    "WarmupCosineLRParams.warmup_num_steps": "Optimizer steps of the warm-up (at least 2 are used).",
    "WarmupCosineLRParams.cos_min_ratio": "Ratio of the initial learning rate at the end of the cosine decay.",
    "WarmupCosineLRParams.warmup_type": "`log` or `linear`, as for WarmupLR.",
    "WarmupCosineLRParams.last_batch_iteration": "The step the schedule starts after; -1 starts at the beginning.",
    "OneCycleScheduler.type": (
        "`OneCycle`: one cycle of the learning rate from `cycle_min_lr` up to `cycle_max_lr` and back down "
        "(optionally in stairs), then `cycle_min_lr`, decayed if `decay_step_size` and `decay_lr_rate` are "
        "set; Adam's first beta cycles the other way."
    ),
    "OneCycleParams.cycle_min_lr": (
        "Learning rate at the start and end of the cycle, and the base of the decay. Required."
    ),
    "OneCycleParams.cycle_max_lr": "Learning rate at the top of the cycle. Required.",
    "OneCycleParams.decay_lr_rate": (
        "n steps after the cycle the learning rate is `cycle_min_lr / (1 + decay_lr_rate * n / "
        "decay_step_size)`; 0: it stays `cycle_min_lr`."
    ),
    "OneCycleParams.cycle_first_step_size": "Optimizer steps from `cycle_min_lr` up to `cycle_max_lr`.",
    "OneCycleParams.cycle_second_step_size": (
        "Optimizer steps from `cycle_max_lr` back down to `cycle_min_lr`; null: `cycle_first_step_size`."
    ),
    "OneCycleParams.cycle_first_stair_count": (
        "Stairs of the rising half: the learning rate (and momentum) holds between them; 0 or less: it moves "
        "every step."
    ),
    "OneCycleParams.cycle_second_stair_count": "Stairs of the falling half; null: `cycle_first_stair_count`.",
    "OneCycleParams.decay_step_size": (
        "The unit of the decay after the cycle, in optimizer steps (see `decay_lr_rate`); 0: no decay."
    ),
    "OneCycleParams.cycle_momentum": (
        "Cycles the first of the optimizer's `betas` between `cycle_max_mom` and `cycle_min_mom` (high while "
        "the learning rate is low) and sets the second to 0.99, as DeepSpeed does; before the first step the "
        "first is `cycle_min_mom`. An optimizer without betas keeps its momentum (logged)."
    ),
    "OneCycleParams.cycle_min_mom": "First beta at the top of the cycle.",
    "OneCycleParams.cycle_max_mom": "First beta at the start and end of the cycle, and the base of its decay.",
    "OneCycleParams.decay_mom_rate": (
        "n steps after the cycle the first beta is `cycle_max_mom * (1 + decay_mom_rate * n / "
        "decay_step_size)`; 0: it stays `cycle_max_mom`."
    ),
    "OneCycleParams.last_batch_iteration": (
        "The step the schedule starts after; -1 starts at the beginning. A loaded checkpoint restores the "
        "schedule's own position."
    ),
    "LRRangeTestScheduler.type": (
        "`LRRangeTest`: the learning rate grows linearly from `lr_range_test_min_lr`, to find the largest "
        "that still trains."
    ),
    "LRRangeTestParams.lr_range_test_min_lr": "Learning rate at the start.",
    "LRRangeTestParams.lr_range_test_step_size": (
        "Optimizer steps per `lr_range_test_step_rate` times `lr_range_test_min_lr` added."
    ),
    "LRRangeTestParams.lr_range_test_step_rate": (
        "After n steps the learning rate is `lr_range_test_min_lr * (1 + lr_range_test_step_rate * n / "
        "lr_range_test_step_size)`."
    ),
    "LRRangeTestParams.lr_range_test_staircase": (
        "true: `n / lr_range_test_step_size` is rounded down, so the learning rate rises in stairs; false: it "
        "rises at every step."
    ),
    "LRRangeTestParams.last_batch_iteration": (
        "The step the schedule starts after; -1 starts at the beginning. A loaded checkpoint restores the "
        "schedule's own position."
    ),
    # bf16, fp16
    "BF16Config.enabled": (
        "Computes in bfloat16: parameters are cast for forward and backward; fp32 master weights and "
        "optimizer states are kept unless the two keys below ask for bf16. At most one of `bf16` and `fp16`."
    ),
    "BF16Config.bf16_master_weights_and_grads": (
        "Keeps the master weights in bf16 (2 bytes per element instead of 4), on whichever tier the optimizer "
        "states live (device, host, NVMe); gradients are still accumulated and reduced in fp32, and become bf16 "
        "where the master weights are (the guide's leaner states section says where they are rounded). Needs "
        "`bf16.enabled`. On the device tier a torch optimizer keeps its "
        "moments in bf16 too, so it needs `bf16_optimizer_states`; zcore's CPU Adam (the host) keeps fp32 "
        "moments beside bf16 weights. Checkpoints hold the bf16 values and load into fp32 runs and back."
    ),
    "BF16Config.bf16_optimizer_states": (
        "Keeps Adam's moments in bf16 too (2 bytes each instead of 4): 6 bytes per trained element for the "
        "master and the moments, against 12 in fp32 and 10 with fp32 moments. Needs "
        "`bf16_master_weights_and_grads`. On NVMe the two go together."
    ),
    "BF16Config.cast_buffers": (
        "Casts floating-point buffers to the compute dtype too, as DeepSpeed does. Off by default: a rotary "
        "embedding's frequencies in low precision are far off at long positions. Needed for a model that adds "
        "a float buffer to its activations, and for batch norms with affine weights (refused without it)."
    ),
    "BF16Config.check_grad_overflow": (
        "Skips a step whose gradients are not finite (counted in `skipped_steps`), as fp16 skips an "
        "overflow; DeepSpeed's default. `false` applies them as they are (gradient clipping, when on, still "
        "skips them: a norm that is not finite cannot clip)."
    ),
    "FP16Config.enabled": "Computes in float16 with loss scaling; fp32 master weights and optimizer states are kept.",
    "FP16Config.cast_buffers": "As `bf16.cast_buffers`.",
    "FP16Config.loss_scale": "0 scales the loss dynamically; a positive value is a static loss scale.",
    "FP16Config.initial_scale_power": "The dynamic scale starts at 2 to this power.",
    "FP16Config.loss_scale_window": (
        "The dynamic scale doubles after this many steps without overflow (not counting the first step after "
        "an overflow or the start), as DeepSpeed 0.19.8 does."
    ),
    "FP16Config.hysteresis": (
        "Overflows absorbed before the scale halves. A step whose gradients overflow is skipped on every rank "
        "either way."
    ),
    "FP16Config.consecutive_hysteresis": (
        "Refills the hysteresis after every step without overflow, not only when the scale grows."
    ),
    "FP16Config.min_loss_scale": "The dynamic scale never halves below this.",
    # zero_optimization
    "ZeroConfig.stage": (
        "0: every rank holds everything (as DDP); 1: optimizer states and fp32 master weights sharded; "
        "2: gradients too; 3: parameters too, gathered module by module as they are used."
    ),
    "ZeroConfig.reduce_bucket_size": (
        "Stages 0-2 pack the trainable parameters, whole and in order, into units of at most the smaller of "
        "this and `allgather_bucket_size` elements, and at most 4,194,304 (a larger parameter gets a unit of "
        "its own); each unit's gradients are reduced as one, overlapping backward. `zcore bench-comm` "
        "measures a good value."
    ),
    "ZeroConfig.allgather_bucket_size": (
        "Stages 0-2: the units that `reduce_bucket_size` describes are also what stages 1-2 all-gather as "
        "one after the step; the smaller of the two sizes them."
    ),
    "ZeroConfig.sub_group_size": (
        "With the optimizer states on NVMe: the most elements stepped and swapped as one sub-group. Unset, "
        "zcore sizes sub-groups to an eighth of the rank's states within the host memory available; set, it "
        "is refused at `initialize` when `offload_optimizer.buffer_count` sub-groups do not fit."
    ),
    "ZeroConfig.stage3_prefetch_bucket_size": (
        "Stage 3: elements gathered ahead of use, as the recorded trace predicts; 0 turns prefetch off."
    ),
    "ZeroConfig.stage3_max_live_parameters": (
        "Stage 3: the most parameter elements gathered at once (prefetch included). A recomputed "
        "checkpointed region stays gathered whole during its backward whatever it says."
    ),
    "ZeroConfig.stage3_max_reuse_distance": (
        "Stage 3: a group whose next use comes within this many elements of other uses stays gathered "
        "(within the live budget) instead of being released and gathered again; 0 keeps only groups used "
        "again immediately."
    ),
    "ZeroConfig.stage3_param_persistence_threshold": (
        "Stage 3: parameter groups of fewer elements stay gathered for the whole step (and on the device "
        "with parameter offload)."
    ),
    "ZeroConfig.stage3_gather_16bit_weights_on_model_save": (
        "`ZcoreTrainer.save_model()` writes the weights in the compute dtype (bf16 or fp16), as DeepSpeed's "
        "Trainer integration does; without it, the fp32 master weights. Streamed at every stage "
        "(`engine.save_16bit_model` writes 16-bit weights either way)."
    ),
    "ZeroConfig.stage3_rank_agreement_check": (
        "Stage 3: when the ranks check that they are about to gather the same groups. `recording`: where no "
        "recorded trace foresees the use (the first step, and departures from the trace). `every_module`: at "
        "every module call, one small all-reduce each, which also catches one rank leaving the order while "
        "the others follow it; for finding a hang, not for production runs."
    ),
    "ZeroConfig.zero_quantized_weights": (
        "ZeRO++ qwZ (stage 3): parameter all-gathers send int8 codes with one fp32 scale per 2048 elements. "
        "Refused below stage 3; nothing changes in a world of one."
    ),
    "ZeroConfig.zero_quantized_gradients": (
        "ZeRO++ qgZ (stages 1-3): gradient reduce-scatters become all-to-alls of int4 codes with one fp32 "
        "scale per 64 elements, in two levels across nodes. Refused at stage 0; nothing changes in a world "
        "of one."
    ),
    "ZeroConfig.zero_hpz_partition_size": (
        "ZeRO++ hpZ (stage 3): ranks in blocks of this many (a node) keep a secondary slice of each gathered "
        "group, so the group's later gathers in the step stay within the block. Must divide the world size; "
        "0, 1 or at least the world size turn it off. Refused with MiCS."
    ),
    "ZeroConfig.mics_shard_size": (
        "MiCS (stage 3): shard over blocks of this many consecutive ranks and replicate across the blocks; "
        "-1 shards over the whole world. Must divide the world size."
    ),
    "ZeroConfig.mics_hierarchical_params_gather": (
        "MiCS: a block spanning several nodes gathers across nodes first, then within the node. The block "
        "must be whole nodes, more than one."
    ),
    "_OffloadSection.device": (
        "`none`: on the compute device; `cpu`: in host memory; `nvme`: in swap files under `nvme_path`, read "
        "through host memory ahead of use and written back after."
    ),
    "_OffloadSection.nvme_path": (
        "Directory for the swap files (required with `device` `nvme`, ignored otherwise). Created with its "
        "parents at `initialize` where missing, as DeepSpeed does; a relative path is taken from the working "
        "directory then. Ranks and jobs may share it."
    ),
    "OffloadOptimizerConfig.pin_memory": (
        "Page-locks the host buffers of the optimizer states (only where CUDA is available)."
    ),
    "OffloadOptimizerConfig.buffer_count": (
        "NVMe: host buffers of one sub-group each for streaming the optimizer states; bounds host memory "
        "together with `sub_group_size`."
    ),
    "OffloadOptimizerConfig.pipeline_read": (
        "NVMe: reads the next sub-group while this one steps. zcore's default is true (DeepSpeed's: false); "
        "false waits for each read."
    ),
    "OffloadOptimizerConfig.pipeline_write": (
        "NVMe: writes the previous sub-group while this one steps. zcore's default is true (DeepSpeed's: "
        "false); false waits for each write."
    ),
    "OffloadOptimizerConfig.fast_init": (
        "Accepted for DeepSpeed configs; zcore's first write of the optimizer states is always direct (one "
        "sub-group at a time), so either value starts the same way."
    ),
    "OffloadParamConfig.pin_memory": (
        "Page-locks the parameter shards resting in host memory (only where CUDA is available)."
    ),
    "OffloadParamConfig.buffer_count": (
        "Staging buffers for shards read ahead of their all-gathers. Unset (with `buffer_size`), zcore sizes "
        "the staging from the model; set, a budget too small for the largest shard is refused at "
        "`initialize` with the value needed."
    ),
    "OffloadParamConfig.buffer_size": "Elements per staging buffer; see `buffer_count`.",
    "OffloadParamConfig.max_in_cpu": (
        "NVMe: this many elements of a rank's parameter shards stay in host memory (the first groups in the "
        "model's order, up to the first that does not fit); the rest go to NVMe. 0 puts every offloaded shard "
        "on NVMe."
    ),
    # aio
    "AioConfig.block_size": "Bytes per I/O request: a multiple of 4096 (O_DIRECT's alignment), at most 1 GiB.",
    "AioConfig.queue_depth": "Requests in flight per I/O worker thread, at most 1024.",
    "AioConfig.intra_op_parallelism": "I/O worker threads sharing each read or write, at most 64.",
    # checkpoint
    "CheckpointConfig.tag_validation": (
        "`Warn`, `Ignore` or `Fail`, in any case. zcore always checks that every rank saves and loads the same "
        "tag (they share one directory), so all three act as `Fail`."
    ),
    "CheckpointConfig.async_save": (
        "What `engine.save_checkpoint` does when its `async_save` argument is not given: true copies this "
        "rank's state into host memory, returns, and writes the same files in the background "
        "(`engine.wait_for_checkpoint()` waits; a later save waits first). The copy's host memory, the rank's "
        "checkpoint bytes, is kept between saves and shown by `engine.memory_report()` and `zcore estimate`."
    ),
    # monitors
    "TensorBoardConfig.enabled": "Records each step's metrics and writes them (rank 0); the package must be installed.",
    "TensorBoardConfig.output_path": "Directory under which the job's directory is made.",
    "TensorBoardConfig.job_name": "The job's directory under `output_path`.",
    "WandbConfig.enabled": (
        "Records each step's metrics and logs them to a wandb run (rank 0; offline with `WANDB_MODE=offline`)."
    ),
    "WandbConfig.group": "The wandb run's group.",
    "WandbConfig.team": "The wandb entity (team) the run belongs to.",
    "WandbConfig.project": "The wandb project.",
    # flops_profiler
    "FlopsProfilerConfig.enabled": (
        "Profiles one optimizer step: parameters, FLOPs and latency per module, printed on rank 0."
    ),
    "FlopsProfilerConfig.recompute_fwd_factor": (
        "Only 0: zcore counts backward FLOPs (recomputation included) instead of estimating them from the forward's."
    ),
    "FlopsProfilerConfig.profile_step": (
        "Optimizer steps completed before the profiled one; the default skips the first, which records the trace."
    ),
    "FlopsProfilerConfig.module_depth": "Depths of the aggregated profile, 0 to this; -1 for all.",
    "FlopsProfilerConfig.top_modules": "Module classes listed per depth by parameters, FLOPs and latency.",
    "FlopsProfilerConfig.detailed": "Prints the module tree with each module's figures.",
    "FlopsProfilerConfig.output_file": "File to write the profile to; null prints it on stdout.",
    # out_of_step_check
    "OutOfStepCheckConfig.enabled": (
        "Whether a rank whose engine call raised (forward, backward or step) and that goes on anyway makes "
        "every rank raise within seconds, naming that rank and what each was doing, instead of leaving them "
        "waiting in its collectives until the process group's timeout. It costs nothing while the ranks agree: "
        "a rank writes to the process group's store only when a call raises or a collective waits longer "
        "than a second. Ranks whose calls all raise alike go on. Waiting ranks are watched on gloo; with "
        "NCCL, the rank whose call raised still raises at its next call."
    ),
    "OutOfStepCheckConfig.patience_seconds": (
        "How long a rank whose call raised waits, at its next call, for every other rank to say where it is "
        "(ranks waiting in zcore's collectives say so within a second or two); past it, it raises naming "
        "the ranks that did not."
    ),
}

# What each section is for, by its class (sections with a class docstring
# use the first paragraph of it when they have no entry here).
SECTION_DESCRIPTIONS: dict[str, str] = {
    "optimizer": (
        "The optimizer `zcore.initialize` builds when none is passed. Absent, and with no optimizer passed, the "
        "engine is for inference only (ZeRO-Inference). The `params` keys depend on `type`."
    ),
    "scheduler": (
        "DeepSpeed's learning-rate schedules, stepped once per optimizer step. Absent: the learning rate "
        "stays (or follows a torch scheduler passed as `lr_scheduler`). The `params` keys depend on `type`."
    ),
    "bf16": "bfloat16 mixed precision.",
    "fp16": "float16 mixed precision with loss scaling.",
    "zero_optimization": "The ZeRO stage, its buckets and budgets, offload, ZeRO++ and MiCS.",
    "zero_optimization.offload_optimizer": "Where the fp32 master weights and the optimizer states live (stages 1-3).",
    "zero_optimization.offload_param": (
        "Where each rank's parameter shards rest between uses: read at stage 3 only; below it the "
        "section is ignored (as DeepSpeed ignores it) and the decided-keys log line says so."
    ),
    "zero_optimization.leaf_module": (
        "Stage 3: the modules gathered whole when entered (leaf modules), marked at `zcore.initialize` as "
        "`zcore.set_z3_leaf_modules` marks them. Each list also takes a single string."
    ),
    "aio": "The asynchronous I/O engine behind NVMe offload (the swap files); checkpoints tune their own I/O.",
    "checkpoint": "Checkpoint saving and loading.",
    "tensorboard": "Step metrics as TensorBoard event files in `output_path/job_name` (rank 0).",
    "csv_monitor": (
        "Step metrics as one CSV file per metric in `output_path/job_name` (rank 0): what `zcore plot` draws."
    ),
    "wandb": "Step metrics logged to Weights & Biases (rank 0).",
    "flops_profiler": "DeepSpeed's flops profiler, at one step.",
    "out_of_step_check": "Ranks whose engine calls fell out of step (one rank's call raised and it went on).",
}

# Keys DeepSpeed does not have: zcore's own.
ZCORE_ONLY = {
    "bf16.cast_buffers",
    "fp16.cast_buffers",
    "zero_optimization.stage3_rank_agreement_check",
    "checkpoint.async_save",
    "out_of_step_check.enabled",
    "out_of_step_check.patience_seconds",
}

# Other names DeepSpeed reads for a key, which zcore reads too.
DEEPSPEED_SPELLINGS: dict[str, list[str]] = {}
for _alias, _key in config_keys.ALIASES.items():
    DEEPSPEED_SPELLINGS.setdefault(_key, []).append(_alias)

# The top of the page.
INTRO = """\
# Configuration reference

<!-- Generated from zcore's config schema by scripts/gen_config_reference.py: do not edit by hand.
     Run `.venv/bin/python scripts/gen_config_reference.py` after changing the schema. -->

zcore reads a DeepSpeed JSON config (a file path, a dict, or a `zcore.config.Config`). Every key it
implements has DeepSpeed's name, default and meaning unless the table says otherwise. Values are read
as DeepSpeed's own models read them and no further: `1` and `0` (and `"true"`, `"yes"`, ...) are
booleans, an integer written as `5e8` is that integer, a string holding a number is that number where the
key takes no string; a boolean is never a number, and an unknown key inside a section is an error naming
the key, the nearest known key and the keys allowed there. `"auto"` (of configs written for transformers)
is filled in by `zcore.trainer.ZcoreTrainer` from its TrainingArguments and the model, as transformers
fills it for DeepSpeed; outside the Trainer it is the default in `zero_optimization`, `fp16` and `bf16`
(as in DeepSpeed), inferred for the batch sizes, and an error elsewhere. Errors are `zcore.ConfigError`.

- **DeepSpeed**: "same" where DeepSpeed reads the key under the same name; "zcore only" for zcore's own
  keys; other names DeepSpeed also reads for the key are listed, and zcore reads them too.
- DeepSpeed's keys that are not zcore's own are listed
  [at the end](#deepspeed-keys-that-are-not-zcores-own): the tuning choices zcore makes itself
  (accepted at any value), and the keys zcore cannot honour (accepted only at a value that changes
  nothing).
- The guides explain the features: [training](../guide/training.md),
  [ZeRO stages](../guide/zero-stages.md), [offload and NVMe](../guide/offload-and-nvme.md),
  [compression](../guide/compression.md), [observability](../guide/observability.md).
"""


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    deepspeed: str
    text: str


@dataclass(frozen=True)
class Section:
    title: str  # the dotted key, with the type's value for one branch of a union
    anchor_key: str  # the dotted key
    text: str
    rows: list[Row]
    level: int  # of its heading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the schema's")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            diff = difflib.unified_diff(
                current.splitlines(), text.splitlines(), str(args.output), "from the schema", lineterm=""
            )
            print("\n".join(diff), file=sys.stderr)
            print(f"{args.output} is stale: run python scripts/gen_config_reference.py", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(args.output)
    return 0


def render() -> str:
    """The whole page."""
    used: set[str] = set()
    sections = list(schema_sections(used))
    unused = sorted(set(DESCRIPTIONS) - used)
    if unused:
        raise LookupError(f"DESCRIPTIONS has entries for fields the schema does not have: {unused}")
    missing_spellings = sorted(set(DEEPSPEED_SPELLINGS) - {s.anchor_key for s in sections} - all_keys(sections))
    if missing_spellings:
        raise LookupError(f"DEEPSPEED_SPELLINGS names keys the schema does not have: {missing_spellings}")
    missing_own = sorted(ZCORE_ONLY - all_keys(sections))
    if missing_own:
        raise LookupError(f"ZCORE_ONLY names keys the schema does not have: {missing_own}")
    parts = [INTRO]
    for section in sections:
        parts.append(render_section(section))
    parts.append(render_unsupported())
    return "\n".join(parts)


def all_keys(sections: list[Section]) -> set[str]:
    return {row.key for section in sections for row in section.rows}


def schema_sections(used: set[str]) -> Iterator[Section]:
    """The top-level keys first, then each section in the schema's order,
    with a section per branch of a union (optimizer and scheduler types)."""
    top = [
        row_for(Config, name, field, name, used)
        for name, field in Config.model_fields.items()
        if not section_models(field.annotation)
    ]
    yield Section("Top level", "", "Keys at the top of the config.", top, level=2)
    for name, field in Config.model_fields.items():
        yield from sections_of(name, field.annotation, used)


def sections_of(key: str, annotation: Any, used: set[str]) -> Iterator[Section]:
    models = section_models(annotation)
    if not models:
        return
    if len(models) > 1:
        # A union chosen by "type": the section's text once, then a table
        # per branch holding its params too.
        yield Section(key, key, section_text(key, models[0]), [], level=2)
        for model in models:
            rows = []
            for name, field in model.model_fields.items():
                nested = section_models(field.annotation)
                if not nested:
                    rows.append(row_for(model, name, field, f"{key}.{name}", used))
                    continue
                (params,) = nested
                rows += [row_for(params, n, f, f"{key}.{name}.{n}", used) for n, f in params.model_fields.items()]
            yield Section(f"{key} of type {type_values(model)}", key, "", rows, level=3)
        return
    (model,) = models
    rows = [
        row_for(model, name, field, f"{key}.{name}", used)
        for name, field in model.model_fields.items()
        if not section_models(field.annotation)
    ]
    yield Section(key, key, section_text(key, model), rows, level=2 + key.count("."))
    for name, field in model.model_fields.items():
        yield from sections_of(f"{key}.{name}", field.annotation, used)


def section_text(key: str, model: type[BaseModel]) -> str:
    if key in SECTION_DESCRIPTIONS:
        return SECTION_DESCRIPTIONS[key]
    doc = (model.__doc__ or "").strip().split("\n\n")[0]
    if not doc:
        raise LookupError(f"section {key!r} ({model.__name__}) has no description: add one to SECTION_DESCRIPTIONS")
    return " ".join(doc.split())


def row_for(model: type[BaseModel], name: str, field: FieldInfo, key: str, used: set[str]) -> Row:
    return Row(
        key=key,
        type=type_text(field),
        default=default_text(field),
        deepspeed=deepspeed_text(key),
        text=description(model, name, field, key, used),
    )


def description(model: type[BaseModel], name: str, field: FieldInfo, key: str, used: set[str]) -> str:
    if field.description:
        return " ".join(field.description.split())
    for cls in model.__mro__:
        entry = f"{cls.__name__}.{name}"
        if entry in DESCRIPTIONS:
            used.add(entry)
            return DESCRIPTIONS[entry]
    raise LookupError(
        f"config key {key!r} ({model.__name__}.{name}) has no description: give the field one, or add "
        f"{model.__name__}.{name} to DESCRIPTIONS in {Path(__file__).name}"
    )


def deepspeed_text(key: str) -> str:
    if key in ZCORE_ONLY:
        return "zcore only"
    if key in DEEPSPEED_SPELLINGS:
        return "same; also " + ", ".join(f"`{name}`" for name in DEEPSPEED_SPELLINGS[key])
    return "same"


# Types.


def section_models(annotation: Any) -> list[type[BaseModel]]:
    """The section models an annotation holds (several for a union of branches)."""
    if isinstance(annotation, type):
        return [annotation] if issubclass(annotation, BaseModel) else []
    return [m for arg in typing.get_args(annotation) for m in section_models(arg)]


def type_values(model: type[BaseModel]) -> str:
    """A branch's `type` values: its Literal, or what its validator accepts."""
    field = model.model_fields["type"]
    values = typing.get_args(field.annotation)
    if values:
        return " or ".join(str(v) for v in values)
    # The Adam branch takes a str and checks it: the names it accepts.
    accepted = [name for name in ("Adam", "AdamW") if _accepts(model, name)]
    return " or ".join(accepted)


def _accepts(model: type[BaseModel], name: str) -> bool:
    try:
        model.model_validate({"type": name})
    except ValueError:
        return False
    return True


_PLAIN = {int: "integer", float: "number", bool: "boolean", str: "string", type(None): "null"}


def type_text(field: FieldInfo) -> str:
    text = _type_name(field.annotation)
    bounds = []
    for meta in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(meta, attr, None)
            if isinstance(meta, annotated_types.BaseMetadata) and value is not None:
                bounds.append(f"{sign} {_number(value)}")
    return f"{text} {', '.join(bounds)}" if bounds else text


def _type_name(annotation: Any) -> str:
    if annotation in _PLAIN:
        return _PLAIN[annotation]
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return (
            "one of " + ", ".join(f"`{json.dumps(v)}`" for v in args) if len(args) > 1 else f"`{json.dumps(args[0])}`"
        )
    if origin is Union:
        names = [_type_name(a) for a in args if a is not type(None)]
        if type(None) in args:
            names.append("null")
        return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if origin is list:
        return f"list of {_type_name(args[0])}s"
    raise TypeError(f"no text for the type {annotation!r}: teach {Path(__file__).name} its name")


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, tuple):
        value = list(value)
    text = f"`{json.dumps(value)}`"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**6:
        text += f" ({_number(value)})"
    return text


def _number(value: int | float) -> str:
    """Large round integers as 5e8 or 2^20; anything else as JSON writes it."""
    if isinstance(value, int) and abs(value) >= 10**6:
        if value & (value - 1) == 0:
            return f"2^{value.bit_length() - 1}"
        mantissa, exponent = value, 0
        while mantissa % 10 == 0:
            mantissa, exponent = mantissa // 10, exponent + 1
        if abs(mantissa) < 10:
            return f"{mantissa}e{exponent}"
    return json.dumps(value)


# Rendering.


def render_section(section: Section) -> str:
    lines = ["#" * section.level + " " + section.title, ""]
    if section.text:
        lines += [section.text, ""]
    if section.rows:
        lines += ["| key | type | default | DeepSpeed | what zcore does |", "| --- | --- | --- | --- | --- |"]
        lines += [
            f"| `{r.key}` | {_cell(r.type)} | {_cell(r.default)} | {_cell(r.deepspeed)} | {_cell(r.text)} |"
            for r in section.rows
        ]
        lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_unsupported() -> str:
    lines = [
        "## DeepSpeed keys that are not zcore's own",
        "",
        "Every config DeepSpeed 0.19.8 accepts, zcore accepts. DeepSpeed's keys that zcore does not hold "
        "under its own name are of three kinds (`zcore.config.keys`). A top-level key that neither reads is "
        "ignored, as DeepSpeed ignores it, and `zcore.initialize` warns naming it.",
        "",
        "### Other names",
        "",
        "DeepSpeed's other names of zcore's keys (its aliases and deprecated names) set the same key; "
        "giving both names different values is refused.",
        "",
        "| DeepSpeed's name | zcore's key |",
        "| --- | --- |",
    ]
    lines += [f"| `{alias}` | `{key}` |" for alias, key in config_keys.ALIASES.items()]
    lines += [f"| `{switch}` | `{section}.device = \"cpu\"` when true |"
              for switch, section in config_keys.OFFLOAD_SWITCHES.items()]
    lines += [
        "",
        "### Tuning choices zcore makes itself",
        "",
        "Accepted at any value of their type, and listed once by `zcore.initialize` (the `zcore` logger, "
        "INFO) with what zcore does instead. So is `\"auto\"` at any key of `zero_optimization` (and its "
        "offload sections), `fp16` and `bf16`, which DeepSpeed reads as the key's default, and "
        "`zero_optimization.sub_group_size = 0`.",
        "",
        "| key | type | what zcore does |",
        "| --- | --- | --- |",
    ]
    lines += [f"| `{key}` | {kind} | {_cell(_sentence(instead))} |"
              for key, (kind, instead) in config_keys.TUNING_KEYS.items()]
    lines += [
        "",
        "### Keys zcore cannot honour",
        "",
        "A config that gives one of these keys at the value in the second column is accepted (the key is "
        "dropped: that value is what zcore does anyway); any other value is refused with the reason, since "
        "zcore would compute or save something else. Keys marked *any value refused* are refused whatever "
        "they hold.",
        "",
        "| key | accepted at | reason |",
        "| --- | --- | --- |",
    ]
    for key, (default, reason) in config_keys.UNSUPPORTED_KEYS.items():
        if default is config_keys._ANY:
            accepted = "*any value refused*"
        elif isinstance(default, (config_keys._Off, config_keys._OneOf)):
            accepted = str(default)
        else:
            accepted = f"`{json.dumps(default)}`"
        lines.append(f"| `{key}` | {accepted} | {_cell(_sentence(reason))} |")
    lines.append("")
    return "\n".join(lines)


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith(".") else text + "."


if __name__ == "__main__":
    sys.exit(main())
