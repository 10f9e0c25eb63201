"""Hugging Face's ``Trainer`` with dscompile doing what its DeepSpeed integration does, from the same ds_config.

A Trainer script changes one import line::

    from dscompile.integrations.huggingface import Trainer, TrainingArguments  # was: from transformers import ...

and ``TrainingArguments(deepspeed="ds_config.json")`` then names a ds_config that dscompile runs: ZeRO 1-3,
offload, bf16/fp16, the config's optimizer and scheduler, gradient clipping and accumulation, with the ``"auto"``
values filled from the arguments by transformers' own code, as for DeepSpeed. The ``deepspeed`` package is not
needed.

Why not through Accelerate's DeepSpeed plugin: that path imports ``deepspeed`` (refusing to run without it),
builds ZeRO-3 models under DeepSpeed's ``zero.Init`` and calls ``deepspeed.initialize``. So the arguments keep the
ds_config away from transformers (``args.deepspeed`` reads None; the config is ``args.ds_config``), the Trainer
runs in its plain data-parallel mode, and the engine takes DeepSpeed's place at the points where the Trainer's
DeepSpeed mode hands over to DeepSpeed's engine:

- ``_wrap_model`` builds the engine (``dscompile.initialize``) over the model and the Trainer's optimizer (or the
  config's), at the first ``train()``; evaluation runs through it after that, through the plain model before;
- ``accelerator.backward`` does what accelerate's ``DeepSpeedEngineWrapper`` does: the accumulation boundary from
  the Trainer's sync flag, ``engine.backward`` (the Trainer already scaled the loss for accumulation),
  ``engine.step()`` at the boundary (reduce, clip, step, scheduler); the Trainer's ``optimizer.step()``,
  ``lr_scheduler.step()`` and ``zero_grad()`` do nothing (accelerate's DeepSpeed wrappers), and the gradient norm
  it logs is the engine's;
- a checkpoint folder holds the engine's checkpoint (``global_stepN/``, ``latest``) beside the Trainer's files,
  and resuming loads it (weights, optimizer, scheduler, counters);
- under AutoTP (``tensor_parallel.autotp_size``) the ranks of a TP group read the same batches: accelerate's
  data-loader sharding over a ``("dp_replicate", "tp")`` mesh, as accelerate does for DeepSpeed's AutoTP;
- ``save_model`` gathers the full weights from the ZeRO (and TP) shards on every rank and writes them with
  ``save_pretrained`` on the main process (full precision: the master weights).

The accelerator is the Trainer's own; two of its methods are replaced on that instance once the engine exists:
``backward`` (above) and ``unwrap_model``, which sees the user's model through the engine, as it sees it
through DeepSpeed's (the Trainer reads the model's class there, e.g. for label smoothing).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dscompile.config import load_config
from dscompile.engines.training import DSCompileEngine, initialize
from dscompile.errors import DSCompileConfigError

_INSTALL_HINT = "dscompile.integrations.huggingface needs transformers and accelerate: pip install 'dscompile[hf]'"
try:
    import transformers
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper, HfDeepSpeedConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
except ImportError as exc:  # a bare install: say which extra brings them
    raise ImportError(_INSTALL_HINT) from exc

log = logging.getLogger("dscompile.integrations.huggingface")

__all__ = ["Trainer", "TrainingArguments", "TrainerDSConfig"]


class TrainerDSConfig(HfDeepSpeedConfig):
    """A ds_config whose ``"auto"`` values the Trainer's arguments fill, by transformers' own rules.

    ``HfTrainerDeepSpeedConfig`` holds those rules (``trainer_config_process`` at argument time,
    ``trainer_config_finalize`` once the model and the step count are known, a mismatch between a set value and
    its argument is an error); its constructor also registers the config where ``from_pretrained`` builds ZeRO-3
    models under DeepSpeed's ``zero.Init``, which must not happen here, so the rules are borrowed onto
    accelerate's plain config holder.
    """

    dtype = HfTrainerDeepSpeedConfig.dtype
    is_auto = HfTrainerDeepSpeedConfig.is_auto
    fill_match = HfTrainerDeepSpeedConfig.fill_match
    fill_only = HfTrainerDeepSpeedConfig.fill_only
    trainer_config_process = HfTrainerDeepSpeedConfig.trainer_config_process
    trainer_config_finalize = HfTrainerDeepSpeedConfig.trainer_config_finalize

    def __init__(self, config_file_or_dict: str | dict) -> None:
        super().__init__(config_file_or_dict)
        self._dtype: torch.dtype | None = None
        self.mismatches: list[str] = []

    def finalized(self, args: Any, model: nn.Module, num_training_steps: int) -> dict[str, Any]:
        """The config with every ``"auto"`` filled (a copy: a later ``train()`` fills it again); an ``"auto"`` no
        argument fills is an error naming its key."""
        filled = copy.deepcopy(self)
        filled.trainer_config_finalize(args, model, num_training_steps)
        left = _auto_keys(filled.config)
        if left:
            raise DSCompileConfigError(
                left[0],
                "is 'auto' but no Trainer argument fills it",
                "set a value (the Trainer fills batch sizes, accumulation, clipping, optimizer/scheduler params, fp16/bf16, bucket sizes)",
            )
        config = filled.config
        tp = autotp_size_of(config)
        per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
        if tp > 1 and config.get("train_batch_size") == per_rank * args.world_size:
            # transformers counts every rank, as DeepSpeed's Trainer path does (its AutoTP engine gets no mpu, so its
            # batch check uses the whole world); the TP ranks of a group read the same batch: count the DP groups
            config["train_batch_size"] = per_rank * (args.world_size // tp)
        return config


def autotp_size_of(config: dict[str, Any]) -> int:
    """``tensor_parallel.autotp_size`` of a ds_config dict (1 without one)."""
    return int((config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)


def _auto_keys(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict):
        return [key for k, v in node.items() for key in _auto_keys(v, f"{path}.{k}" if path else k)]
    return [path] if node == "auto" else []


_ACCELERATE_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"


def _launched_with_deepspeed() -> bool:
    return os.environ.get(_ACCELERATE_USE_DEEPSPEED, "false").lower() == "true"


def _accelerate_launch_config(mixed_precision: str) -> dict[str, Any]:
    """The ds_config ``accelerate launch --use_deepspeed`` described in the environment (its config file, or its
    ``zero_stage``/offload/accumulation/clipping options, and ``--mixed_precision``), read by accelerate's own
    ``DeepSpeedPlugin``, as transformers reads it for DeepSpeed."""
    plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision(mixed_precision)
    config = dict(plugin.deepspeed_config)
    config.pop("steps_per_print", None)  # accelerate's float('inf') only silences DeepSpeed's own logging
    return config


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' ``TrainingArguments``; ``deepspeed=`` (a path, JSON or dict) names a ds_config dscompile runs.

    The config is kept from transformers (``args.deepspeed`` reads None, so neither Accelerate nor
    ``from_pretrained`` reaches for the ``deepspeed`` package) and held, its ``"auto"`` values filled from these
    arguments, as ``args.ds_config`` (a ``TrainerDSConfig``; ``args.ds_config.config`` is the dict). Without
    ``deepspeed=``, a script started by ``accelerate launch --use_deepspeed`` takes the launcher's DeepSpeed
    settings, as transformers does; ``ACCELERATE_USE_DEEPSPEED`` is then set to false in this process, so that
    accelerate does not enter its DeepSpeed mode.
    """

    def __post_init__(self) -> None:
        source, self.deepspeed = self.deepspeed, None
        launched = _launched_with_deepspeed()
        if launched:
            os.environ[_ACCELERATE_USE_DEEPSPEED] = "false"
        super().__post_init__()
        if not source and launched:
            source = _accelerate_launch_config(self.mixed_precision)
        self.ds_config: TrainerDSConfig | None = None
        if source:
            self.ds_config = TrainerDSConfig(source)
            self.ds_config.trainer_config_process(self)


class _EngineBackward:
    """``accelerator.backward`` while the engine trains: what accelerate's ``DeepSpeedEngineWrapper`` does for
    DeepSpeed's engine. At the boundary it also notes the learning rates the step uses (see ``_EngineScheduler``)."""

    def __init__(self, accelerator: Any, engine: DSCompileEngine, scheduler: _EngineScheduler) -> None:
        self.accelerator = accelerator
        self.wrapper = DeepSpeedEngineWrapper(engine)
        self.scheduler = scheduler

    def __call__(self, loss: torch.Tensor, **kwargs: Any) -> None:
        sync = self.accelerator.sync_gradients
        if sync:
            self.scheduler.used_lr = self.wrapper.engine.get_lr()
        kwargs.setdefault("scale_wrt_gas", False)  # the Trainer divided the loss by the accumulation steps
        self.wrapper.backward(loss, sync_gradients=sync, **kwargs)


class _EngineScheduler(DeepSpeedSchedulerWrapper):
    """The engine's scheduler as the Trainer sees it: ``step()`` does nothing (the engine steps it at the boundary,
    and skips it with the optimizer on an fp16 overflow, as DeepSpeed).

    The Trainer logs ``get_last_lr()`` after the engine stepped. Under DeepSpeed a scheduler from the config is
    stepped by the engine too (the next step's rate is logged), while the Trainer's own is stepped by the Trainer
    after logging (this step's rate is logged); ``logs_step_lr`` keeps the second for the Trainer's scheduler.
    """

    used_lr: list[float] | None = None

    def __init__(self, scheduler: Any, optimizer: Any, logs_step_lr: bool) -> None:
        super().__init__(scheduler, optimizer)
        self.logs_step_lr = logs_step_lr

    def get_last_lr(self) -> list[float]:
        return self.used_lr if self.logs_step_lr and self.used_lr is not None else self.scheduler.get_last_lr()


class Trainer(transformers.Trainer):
    """transformers' ``Trainer``; with ``TrainingArguments(deepspeed=...)`` from this module, dscompile trains.

    Without a ds_config it is transformers' Trainer unchanged. ``trainer.engine`` is the ``DSCompileEngine``
    once ``train()`` built it (also ``trainer.model_wrapped``); ``trainer.model`` stays the user's model, whose
    parameters are ZeRO-3 shards while the engine trains it.
    """

    def __init__(self, model: nn.Module | None = None, args: Any = None, *rest: Any, **kwargs: Any) -> None:
        if args is not None and not isinstance(args, TrainingArguments) and (getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None)):
            raise DSCompileConfigError(
                "deepspeed",
                "transformers.TrainingArguments with a DeepSpeed config (deepspeed=..., or accelerate launch --use_deepspeed) hand it to the DeepSpeed package",
                "import TrainingArguments from dscompile.integrations.huggingface too",
            )
        self.engine: DSCompileEngine | None = None
        self._engine_steps_trainers_scheduler = False
        super().__init__(model, args, *rest, **kwargs)
        if self.ds_config is not None:
            self._refuse_unsupported_arguments()

    @property
    def ds_config(self) -> TrainerDSConfig | None:
        return getattr(self.args, "ds_config", None)

    def _refuse_unsupported_arguments(self) -> None:
        args = self.args
        refused = {
            "torch_compile": (args.torch_compile, "dscompile compiles the model itself; drop torch_compile"),
            "fsdp": (bool(args.fsdp), "FSDP and a ds_config exclude each other; drop one"),
            "auto_find_batch_size": (args.auto_find_batch_size, "set per_device_train_batch_size"),
            "parallelism_config": (args.parallelism_config is not None, "tensor/sequence/context parallelism through the Trainer is not built"),
            "bf16_full_eval": (args.bf16_full_eval, "the engine evaluates in the ds_config's precision; drop it"),
            "fp16_full_eval": (args.fp16_full_eval, "the engine evaluates in the ds_config's precision; drop it"),
            "optim": (args.optim in ("lomo", "adalomo"), "LOMO steps inside backward; use another optimizer"),
        }
        for key, (bad, fix) in refused.items():
            if bad:
                raise DSCompileConfigError(f"TrainingArguments.{key}", "is not supported with a dscompile ds_config", fix)
        config = self.ds_config.config
        for key, bad in (
            ("pipeline", "pipeline" in config),
            ("sequence_parallel_size", int(config.get("sequence_parallel_size", 1) or 1) > 1),
        ):
            if bad:
                raise DSCompileConfigError(key, "is not run through the Trainer yet", "train with dscompile.initialize directly, or drop the key")

    # -- AutoTP: the ranks of a tensor-parallel group read the same batches ---------------------------------
    @property
    def autotp_size(self) -> int:
        """``tensor_parallel.autotp_size`` of the ds_config (1 without one)."""
        return autotp_size_of(self.ds_config.config) if self.ds_config is not None else 1

    def get_tp_size(self) -> int:
        """The config's ``autotp_size``, as transformers reads it under DeepSpeed: the Trainer divides the world by it
        for the data-parallel batch and for ``average_tokens_across_devices`` (TP ranks count the same tokens)."""
        return self.autotp_size if self.autotp_size > 1 else super().get_tp_size()

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        tp = self.autotp_size
        if tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            world = self.accelerator.num_processes
            if world % tp:
                raise DSCompileConfigError("tensor_parallel.autotp_size", f"{tp} does not divide the {world} processes", "launch a multiple of it")
            # accelerate shards the batches over a mesh's data-parallel dimension and repeats them over "tp", as it
            # does for DeepSpeed's AutoTP; the (dp, tp) rank order is the engine's (TP groups of consecutive ranks)
            mesh = init_device_mesh(self.accelerator.device.type, (world // tp, tp), mesh_dim_names=("dp_replicate", "tp"))
            self.accelerator._prepare_device_mesh = lambda: mesh

    # -- the accelerator: no autocast, no DDP no_sync (the engine is neither accelerate's nor DDP) -----------
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        built = super()._build_accelerator_args(**kwargs)
        if self.ds_config is not None:
            built["mixed_precision"] = "no"  # the ds_config's bf16/fp16 sections set the precision, in the graphs
            plugin = built.get("gradient_accumulation_plugin")
            if plugin is not None:
                plugin.sync_each_batch = True  # the Trainer then opens no DDP no_sync around micro-batches
        return built

    # -- building the engine -----------------------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        if self.ds_config is not None and "optimizer" in self.ds_config.config and self.engine is None:
            return None  # the config's optimizer, built by the engine as DeepSpeed builds it
        return super().create_optimizer(model)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if self.ds_config is None:
            return super()._wrap_model(model, training, dataloader)
        if self.engine is not None:
            return self.engine
        if not training:
            return model  # evaluation before training: the whole model, in eager PyTorch
        self.engine = self._build_engine()
        return self.engine

    def _build_engine(self) -> DSCompileEngine:
        assert self.ds_config is not None
        config = self.ds_config.finalized(self.args, self.model, self.state.max_steps)
        optimizer = None if "optimizer" in config else self.optimizer
        engine, _, _, _ = initialize(model=self.model, optimizer=optimizer, config=load_config(config))
        if not isinstance(engine, DSCompileEngine):
            raise DSCompileConfigError("pipeline", "the Trainer drives a DSCompileEngine, not a pipeline engine", "drop the pipeline section")
        self.optimizer = DeepSpeedOptimizerWrapper(engine.optimizer)  # step/zero_grad: the engine's, at the boundary
        self.optimizer._is_accelerate_prepared = True  # as accelerate marks it under DeepSpeed: not wrapped again
        self.model_wrapped = engine
        accelerator = self.accelerator
        original_unwrap = type(accelerator).unwrap_model
        accelerator.unwrap_model = lambda m, *a, **kw: original_unwrap(accelerator, self.model if m is engine else m, *a, **kw)
        if self.args.process_index == 0:
            log.info("dscompile engine built from the ds_config: %s", json.dumps(config, sort_keys=True, default=str))
        return engine

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        engine = self.engine
        if engine is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if isinstance(self.lr_scheduler, _EngineScheduler):
            return self.lr_scheduler
        trainers = engine.lr_scheduler is None or self._engine_steps_trainers_scheduler  # (a second train() finds it set)
        self._engine_steps_trainers_scheduler = trainers
        if engine.lr_scheduler is None:  # no scheduler section: the Trainer's (or the one passed in), stepped by the engine
            if self.lr_scheduler is None:
                super().create_scheduler(num_training_steps, optimizer=engine.optimizer)
            if getattr(self.lr_scheduler, "optimizer", engine.optimizer) is not engine.optimizer:
                self.lr_scheduler.optimizer = engine.optimizer  # ZeRO steps the shards: the scheduler sets their rates
            engine.install_lr_scheduler(self.lr_scheduler)
        self.lr_scheduler = _EngineScheduler(engine.lr_scheduler, self.optimizer, logs_step_lr=trainers)
        self._created_lr_scheduler = True
        self.accelerator.backward = _EngineBackward(self.accelerator, engine, self.lr_scheduler)
        return self.lr_scheduler

    # -- the step: the engine clipped and stepped inside backward ------------------------------------------
    def _clip_grad_norm(self, model: nn.Module) -> Any:
        if self.engine is None:
            return super()._clip_grad_norm(model)
        return self.engine.get_global_grad_norm()

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self.engine is None:
            return super()._get_grad_norm(model, grad_norm)
        return self.engine.get_global_grad_norm()

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Full weights, gathered from the ZeRO shards on every rank, written by the main process with ``save_pretrained``."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = self.engine.full_state_dict()  # a collective: every rank calls save_model, as the Trainer does
        self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(output_dir)  # every rank: its shards, the optimizer, the scheduler, the counters

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if self.ds_config is not None and (self.engine is not None or os.path.isfile(os.path.join(resume_from_checkpoint, "latest"))):
            return  # the engine's checkpoint holds the weights (the master copy), loaded with the optimizer
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self._load_engine_checkpoint(checkpoint)

    def _load_best_model(self) -> None:
        if self.engine is None:
            return super()._load_best_model()
        self._load_engine_checkpoint(self.state.best_model_checkpoint)

    def _load_engine_checkpoint(self, folder: str) -> None:
        assert self.engine is not None
        if not os.path.isfile(os.path.join(folder, "latest")):
            raise DSCompileConfigError(
                "resume_from_checkpoint",
                f"{folder} holds no engine checkpoint (no 'latest' file)",
                "resume from a checkpoint the dscompile Trainer saved without save_only_model",
            )
        path, _ = self.engine.load_checkpoint(folder)
        if path is None:
            raise DSCompileConfigError("resume_from_checkpoint", f"nothing loaded from {folder}", "pass a checkpoint-N folder the Trainer saved")
        trainers_scheduler = os.path.join(folder, "scheduler.pt")
        if self._engine_steps_trainers_scheduler and os.path.isfile(trainers_scheduler):
            # DeepSpeed's Trainer path steps the Trainer's own scheduler outside DeepSpeed's engine and saves it here
            self.engine.lr_scheduler.load_state_dict(torch.load(trainers_scheduler, weights_only=True))
