"""``PipelineEngine``: DeepSpeed's pipeline engine API over stages cut from the captured graph.

    engine = PipelineEngine(model, config, optimizer)      # config has a "pipeline" section
    loss = engine.train_batch(data_iter)                   # micro_batches x next(data_iter)
    engine.eval_batch(data_iter)

``model(*micro_batch)`` must return the loss (or pass ``loss_fn``: ``loss_fn(model(*batch[:-1]),
batch[-1])``). On the first batch (or at construction with ``example_batch=``) the model is
captured whole by Dynamo, partitioned (``passes/pipeline_split.py``) and cut into stages; each
rank keeps only its stages (their parameters; the others are freed), compiles them with the
dscompile backend and runs its schedule. Ranks are laid out ``rank = data_parallel_rank * stages
+ stage``; gradients are averaged over the data-parallel group and summed over the ranks that
share a tied parameter. Every rank consumes ``micro_batches`` items of its ``data_iter`` per
``train_batch`` (ranks that read no inputs may pass None once the engine is built).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from dscompile.config import DSConfig, load_config
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.runtime.pipeline_executor import Timeline, run_actions, run_forward_only
from dscompile.runtime.pipeline_p2p import P2P
from dscompile.runtime.pipeline_schedules import build_schedule

log = logging.getLogger("dscompile.pipeline_engine")

LATEST = "latest"


class _WithLoss(nn.Module):
    """``loss_fn(model(*inputs), labels)`` as one module, so the loss is part of the graph."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model(*batch[:-1]), batch[-1])


def capture_graph(module: nn.Module, example_args: Sequence[Any]) -> tuple[torch.fx.GraphModule, set[torch.fx.Node]]:
    """The whole forward as one Dynamo graph whose parameters and buffers are ``get_attr`` of ``module``."""
    captured: dict[str, Any] = {}

    def grab(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        captured["gm"], captured["inputs"] = gm, list(example_inputs)
        return gm.forward

    compiled = torch.compile(module, backend=grab, fullgraph=True, dynamic=False)
    compiled(*example_args)
    gm, inputs = captured["gm"], captured["inputs"]
    names: dict[int, str] = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    for name, b in module.named_buffers():
        names.setdefault(id(b), name)
    arg_ids = {id(a): i for i, a in enumerate(example_args)}
    graph = gm.graph
    param_nodes: set[torch.fx.Node] = set()
    user_inputs: list[tuple[int, torch.fx.Node]] = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_compute = next(n for n in graph.nodes if n.op != "placeholder")
    for node, value in zip(placeholders, inputs):
        if id(value) in names:
            with graph.inserting_before(first_compute), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the Dynamo module does not hold the model's attributes yet
                attr = graph.get_attr(names[id(value)])
            attr.meta = dict(node.meta)
            node.replace_all_uses_with(attr)
            graph.erase_node(node)
            if isinstance(value, nn.Parameter) and value.requires_grad:
                param_nodes.add(attr)
        elif id(value) in arg_ids:
            user_inputs.append((arg_ids[id(value)], node))
        else:
            raise DSCompileNotSupportedError(
                "pipeline", f"capturing a model whose graph reads a tensor that is neither an input nor a parameter/buffer ({node.name})"
            )
    if [i for i, _ in user_inputs] != sorted(i for i, _ in user_inputs) or len(user_inputs) != len(example_args):
        raise DSCompileNotSupportedError("pipeline", "models that do not read every batch tensor in order (pass only the tensors forward uses)")
    return torch.fx.GraphModule(module, graph), param_nodes


class GraphStageRunner:
    """Runs one stage GraphModule per micro-batch, keeping what its backward needs.

    With ``checkpoint`` the forward keeps only its inputs (and RNG state) and is recomputed in
    backward.
    """

    def __init__(self, fn: Callable[..., Any], checkpoint: bool = False) -> None:
        self.fn = fn
        self.checkpoint = checkpoint
        self.saved: dict[int, Any] = {}

    def forward(self, micro_batch: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if not torch.is_grad_enabled():
            return list(self.fn(*inputs))
        if self.checkpoint:
            rng = torch.get_rng_state()
            with torch.no_grad():
                outputs = list(self.fn(*inputs))
            self.saved[micro_batch] = (inputs, None, rng)
            return outputs
        outputs = list(self.fn(*inputs))
        self.saved[micro_batch] = (inputs, outputs, None)
        return [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]

    def backward(self, micro_batch: int, output_grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        inputs, outputs, rng = self.saved.pop(micro_batch)
        if outputs is None:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(rng)
                outputs = list(self.fn(*inputs))
        pairs = [(o, g) for o, g in zip(outputs, output_grads) if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs]


class PipelineEngine:
    """Pipeline-parallel (optionally x data-parallel) training of a model on this rank's stages."""

    def __init__(
        self,
        model: nn.Module,
        config: Any,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        *,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        example_batch: Sequence[Any] | None = None,
    ) -> None:
        self.config: DSConfig = load_config(config)
        pcfg = self.config.sections.get("pipeline_parallel")
        if pcfg is None:
            raise DSCompileConfigError("pipeline", "PipelineEngine needs a 'pipeline' section", 'add "pipeline": {"stages": N}')
        zero = self.config.sections.get("zero_optimization")
        if zero is not None and zero.stage > 0:
            raise DSCompileNotSupportedError("zero_optimization", "ZeRO combined with pipeline parallelism")
        self.pcfg = pcfg
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.global_rank = dist.get_rank() if self.world_size > 1 else 0
        self.num_stages = pcfg.stages
        if self.world_size % self.num_stages:
            raise DSCompileConfigError(
                "pipeline.stages",
                f"world size {self.world_size} is not divisible by {self.num_stages} pipeline stages",
                f"launch a multiple of {self.num_stages} processes or change pipeline.stages",
            )
        self.dp_size = self.world_size // self.num_stages
        self.stage_id = self.global_rank % self.num_stages
        self.dp_id = self.global_rank // self.num_stages
        self.chunks = pcfg.virtual_stages or 1
        gas = self.config.gradient_accumulation_steps
        if pcfg.micro_batches is not None and gas not in (None, 1, pcfg.micro_batches):
            raise DSCompileConfigError("pipeline.micro_batches", f"{pcfg.micro_batches} contradicts gradient_accumulation_steps {gas}", "set only one of them")
        self.micro_batches = pcfg.micro_batches or gas or 1
        if pcfg.schedule == "interleaved_1f1b" and self.micro_batches % self.num_stages:
            raise DSCompileConfigError(
                "pipeline.micro_batches", f"interleaved_1f1b needs micro_batches ({self.micro_batches}) divisible by stages ({self.num_stages})"
            )
        self.module = model
        self.root: nn.Module = _WithLoss(model, loss_fn) if loss_fn is not None else model
        self._strip = "model." if loss_fn is not None else ""
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.program: Any = None
        self.facts: Any = None
        self.last_timeline: Timeline | None = None
        self.last_batch_seconds = 0.0
        self._pending_load: tuple[Any, ...] | None = None
        self._dp_groups: dict[int, Any] = {}
        self._tied: list[tuple[list[nn.Parameter], Any]] = []
        if self.world_size > 1:
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(t, src=0)
        self._make_dp_groups()
        if example_batch is not None:
            self._build(example_batch)

    # -- layout --------------------------------------------------------------------------------
    def rank_of_stage(self, stage: int) -> int:
        """Global rank holding model stage ``stage`` in this rank's pipeline."""
        return self.dp_id * self.num_stages + stage % self.num_stages

    @property
    def local_stages(self) -> list[int]:
        return [s for s in range(self.num_stages * self.chunks) if s % self.num_stages == self.stage_id]

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def _make_dp_groups(self) -> None:
        if self.dp_size == 1:
            return
        for s in range(self.num_stages):
            group = dist.new_group([d * self.num_stages + s for d in range(self.dp_size)])
            self._dp_groups[s] = group

    # -- building the stages -------------------------------------------------------------------
    def _build(self, example: Sequence[Any]) -> None:
        from dscompile.passes.pipeline_split import graph_facts, plan_partition, split_program

        gm, param_nodes = capture_graph(self.root, tuple(example))
        facts = graph_facts(gm, param_nodes, self._strip)
        plan = plan_partition(
            facts,
            self.num_stages * self.chunks,
            self.pcfg.partition_method,
            split_points=self.pcfg.split_points,
            memory_weight=self.pcfg.cost_memory_weight,
            flops_per_byte=self.pcfg.cost_flops_per_byte,
            strip=self._strip,
        )
        self.program = split_program(gm, self.root, facts, plan, param_nodes, tuple(example))
        self.facts = facts
        if self.config.dump and self.global_rank == 0:
            self._dump(gm)
        owners: dict[int, set[int]] = {}
        by_id: dict[int, nn.Parameter] = {}
        for spec in self.program.stages:
            for p in spec.module.parameters():
                owners.setdefault(id(p), set()).add(spec.index % self.num_stages)
                by_id[id(p)] = p
        mine = {pid for pid, ranks in owners.items() if self.stage_id in ranks}
        self._params = [p for pid, p in by_id.items() if pid in mine and p.requires_grad]
        self._owned_ids = mine
        with torch.no_grad():
            for p in self.root.parameters():
                if id(p) not in mine:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # another rank's stage
        self._make_tied_groups(owners, by_id)
        checkpoint = self.pcfg.activation_checkpoint_interval > 0
        self.runners = {}
        for s in self.local_stages:
            module = self.program.stages[s].module
            fn = torch.compile(module, backend="dscompile", options=self.config, dynamic=False) if self.pcfg.compile else module
            self.runners[s] = GraphStageRunner(fn, checkpoint)
        self._filter_optimizer()
        log.info("rank %d: stages %s, %d parameters", self.global_rank, self.local_stages, sum(p.numel() for p in self._params))
        if self._pending_load is not None:
            args, self._pending_load = self._pending_load, None
            self.load_checkpoint(*args)

    def _make_tied_groups(self, owners: dict[int, set[int]], by_id: dict[int, nn.Parameter]) -> None:
        tied_sets: dict[tuple[int, ...], list[int]] = {}
        for pid, ranks in owners.items():
            if len(ranks) > 1 and by_id[pid].requires_grad:
                tied_sets.setdefault(tuple(sorted(ranks)), []).append(pid)
        for ranks, pids in sorted(tied_sets.items()):
            for d in range(self.dp_size):
                members = [d * self.num_stages + r for r in ranks]
                group = dist.new_group(members) if self.world_size > 1 else None
                if d == self.dp_id and self.stage_id in ranks:
                    self._tied.append(([by_id[pid] for pid in pids], group))

    def _filter_optimizer(self) -> None:
        if self.optimizer is None and self.config.optimizer is not None:
            from dscompile.runtime.optimizers import build_optimizer

            self.optimizer = build_optimizer(self.config.optimizer, self._params)
            if self.lr_scheduler is None and self.config.scheduler is not None:
                from dscompile.runtime.schedulers import build_scheduler

                self.lr_scheduler = build_scheduler(self.config.scheduler, self.optimizer)
            return
        if self.optimizer is None:
            return
        if self.optimizer.state:
            raise DSCompileConfigError("optimizer", "already holds state; the pipeline engine must partition it before the first step")
        mine = {id(p) for p in self._params}
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in mine]  # in place: the caller's object stays valid

    def _dump(self, gm: torch.fx.GraphModule) -> None:
        from dscompile.dump import Dumper
        from dscompile.passes.pipeline_split import describe_plan
        from dscompile.pipeline import PassContext

        root = Path(self.config.dump)
        dumper = Dumper(root)
        ctx = PassContext(config=self.config, graph_kind="pre_autograd", graph_name="pipeline.dynamo")
        dumper.dump(gm, ctx, "pipeline_split", step=1)
        text = describe_plan(self.program, self.program.plan, self.facts)
        (root / "pipeline_stages.txt").write_text(text)
        for spec in self.program.stages:
            (root / f"pipeline_stage_{spec.index}.py").write_text(spec.module.print_readable(print_output=False))

    # -- training ------------------------------------------------------------------------------
    def _fetch(self, data_iter: Iterator[Any] | None) -> list[Sequence[Any]] | None:
        if data_iter is None:
            return None
        batches = []
        for _ in range(self.micro_batches):
            item = next(data_iter)
            batches.append(tuple(item) if isinstance(item, (tuple, list)) else (item,))
        return batches

    def _ensure_built(self, batches: list[Sequence[Any]] | None) -> None:
        if self.program is None:
            if batches is None:
                raise RuntimeError("PipelineEngine: the first train_batch/eval_batch needs a data_iter on every rank (or pass example_batch=)")
            self._build(batches[0])

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` micro-batches; the mean loss (same on every rank)."""
        batches = self._fetch(data_iter)
        self._ensure_built(batches)
        if self.world_size > 1:
            dist.barrier()
        begin = time.perf_counter()
        actions = [a for a in build_schedule(self.pcfg.schedule, self.stage_id, self.num_stages, self.micro_batches, self.chunks)]
        p2p = P2P(self.global_rank)
        losses, timeline = run_actions(
            actions, self.program.stages, self.runners, p2p, self.rank_of_stage, batches, self.program.loss, 1.0 / self.micro_batches
        )
        self.last_timeline = timeline
        self._reduce_gradients()
        self._step()
        loss = self._mean_loss(losses)
        self.last_batch_seconds = time.perf_counter() - begin
        return loss

    def eval_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Forward only over ``micro_batches`` micro-batches; the mean loss (same on every rank)."""
        batches = self._fetch(data_iter)
        self._ensure_built(batches)
        p2p = P2P(self.global_rank)
        losses = run_forward_only(self.program.stages, self.local_stages, self.runners, p2p, self.rank_of_stage, batches, self.program.loss, self.micro_batches)
        return self._mean_loss(losses)

    def _mean_loss(self, losses: dict[int, torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        if losses:
            total = torch.stack([losses[i].double() for i in sorted(losses)]).mean()
        if self.world_size > 1:
            dist.all_reduce(total)  # only the last stage of each pipeline contributes
            total /= self.dp_size
        return total.float()

    def _reduce_gradients(self) -> None:
        for params, group in self._tied:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            _unflatten_into(flat, params)
        if self.dp_size > 1:
            grads = [p for p in self._params]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in grads])
            dist.all_reduce(flat, group=self._dp_groups[self.stage_id])
            flat /= self.dp_size
            _unflatten_into(flat, grads)

    def _step(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("PipelineEngine.train_batch: no optimizer; pass optimizer= or set 'optimizer' in the config")
        if self.config.gradient_clipping > 0:
            self._clip(self.config.gradient_clipping)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1

    def _clip(self, max_norm: float) -> None:
        """Clip by the norm of the whole model: each tied parameter is counted once (lowest rank)."""
        skip: set[int] = set()
        for params, group in self._tied:
            members = dist.get_process_group_ranks(group) if group is not None else [self.global_rank]
            if self.global_rank != min(members):
                skip.update(id(p) for p in params)
        sq = torch.zeros((), dtype=torch.float64)
        for p in self._params:
            if p.grad is not None and id(p) not in skip:
                sq += p.grad.double().pow(2).sum()
        if self.world_size > 1:
            dist.all_reduce(sq)
            sq /= self.dp_size
        norm = float(sq.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self._params:
                if p.grad is not None:
                    p.grad.mul_(coef)

    # -- state ---------------------------------------------------------------------------------
    def stage_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by the model's own names (detached copies)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.root.named_parameters():
            if id(p) in self._owned_ids:
                out[name[len(self._strip) :] if name.startswith(self._strip) else name] = p.detach().clone()
        return out

    def idle_fraction(self) -> float:
        return self.last_timeline.idle_fraction() if self.last_timeline else 0.0

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None) -> Path:
        """Per stage ``pipe_stage_NN_model_states.pt`` (by parameter name) and per pipeline rank
        ``pipe_rank_NN_states.pt`` (optimizer, scheduler, counters); data-parallel rank 0 writes."""
        if self.program is None:
            raise RuntimeError("save_checkpoint before the first train_batch: nothing is partitioned yet")
        tag = tag or f"global_step{self.global_steps}"
        directory = Path(save_dir) / str(tag)
        if self.dp_id == 0:
            directory.mkdir(parents=True, exist_ok=True)
            for s in self.local_stages:
                spec = self.program.stages[s]
                state = {name: t.detach() for name, t in spec.module.state_dict().items()}
                torch.save(state, directory / f"pipe_stage_{s:02d}_model_states.pt")
            torch.save(
                {
                    "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                    "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                    "global_steps": self.global_steps,
                    "bounds": self.program.plan.bounds,
                    "client_state": client_state or {},
                },
                directory / f"pipe_rank_{self.stage_id:02d}_states.pt",
            )
        if self.world_size > 1:
            dist.barrier()
        if self.global_rank == 0:
            (Path(save_dir) / LATEST).write_text(str(tag))
        return directory

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_optimizer_states: bool = True) -> tuple[str | None, dict | None]:
        """Restore parameters by name from every stage file (so another stage count works for the
        weights); optimizer and counters only when the partition is the same."""
        if self.program is None:
            self._pending_load = (load_dir, tag, load_optimizer_states)
            return None, None
        load_dir = Path(load_dir)
        if tag is None:
            tag = (load_dir / LATEST).read_text().strip()
        directory = load_dir / str(tag)
        files = sorted(directory.glob("pipe_stage_*_model_states.pt"))
        if not files:
            raise FileNotFoundError(f"no pipeline stage checkpoints in {directory}")
        saved: dict[str, torch.Tensor] = {}
        for f in files:
            saved.update(torch.load(f, map_location="cpu", weights_only=True))
        with torch.no_grad():
            for s in self.local_stages:
                module = self.program.stages[s].module
                for name, t in module.state_dict().items():
                    if name not in saved:
                        raise KeyError(f"checkpoint {directory} has no tensor {name!r} for stage {s}")
                    t.copy_(saved[name])
        rank_file = directory / f"pipe_rank_{self.stage_id:02d}_states.pt"
        client = None
        if rank_file.is_file():
            state = torch.load(rank_file, map_location="cpu", weights_only=False)
            client = state["client_state"]
            if state["bounds"] == self.program.plan.bounds:
                if load_optimizer_states and self.optimizer is not None and state["optimizer"] is not None:
                    self.optimizer.load_state_dict(state["optimizer"])
                if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
                    self.lr_scheduler.load_state_dict(state["lr_scheduler"])
                self.global_steps = state["global_steps"]
            else:
                log.warning("checkpoint %s was partitioned differently: loaded the weights only", directory)
        return str(directory), client


def _unflatten_into(flat: torch.Tensor, params: Sequence[nn.Parameter]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        value = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = value.clone()
        else:
            p.grad.copy_(value)
        offset += n
