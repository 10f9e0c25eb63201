"""The training workload the 1-bit optimizer tests and ``bench/onebit.py`` share.

A small GPT (``dscompile.zoo``) learns a fixed random bigram language (every token has four
likely successors), so losses fall well below ``ln(vocab)`` and optimizers can be compared by
their final loss. Each rank draws its own batches; ``train_rank`` runs on one rank of a
``run_distributed`` world, steps the named optimizer in a plain loop and returns its losses,
per-step bytes and times; ``train_rank_engine`` trains the same through ``dscompile.initialize`` (the
engine does the gradient communication, optionally with ZeRO-1).

Optimizer names: ``adamw`` (torch's AdamW after an fp32 all-reduce of the gradients, counted
like the others), ``onebitadam``, ``zerooneadam``, ``onebitlamb``, and ``lamb`` (1-bit LAMB whose
warm-up never ends: LAMB with fp32 gradient averaging, the uncompressed reference of
``onebitlamb``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dscompile.engines.training import initialize
from dscompile.runtime.onebit import OPTIMIZERS, Collectives, CommStats
from dscompile.runtime.onebit.engine import bytes_sent

VOCAB = 64
SUCCESSORS = 4
SUCCESSOR_PROBS = (0.55, 0.25, 0.12, 0.08)


@dataclass
class Workload:
    """What to train and how: model size, data, optimizer name and its keyword arguments."""

    optimizer: str
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 32
    d_model: int = 32
    n_layers: int = 2
    seed: int = 0
    lr_warmup_steps: int = 0
    """Linear learning-rate warm-up from 0 over these steps (every optimizer gets the same schedule)..."""
    lr_final_fraction: float = 1.0
    """...then linear decay to this fraction of the peak at the last step (1.0: constant)."""
    bandwidth_bytes_per_s: float | None = None
    """Emulate a slow network: every collective sleeps ``bytes sent / bandwidth`` before it runs."""
    eval_batches: int = 4
    zero_stage: int = 0
    """``train_rank_engine`` only: ``zero_optimization.stage``."""


def bigram_table(seed: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """``(successors [vocab, 4], probabilities [4])`` of the fixed language."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    successors = torch.stack([torch.randperm(vocab, generator=gen)[:SUCCESSORS] for _ in range(vocab)])
    return successors, torch.tensor(SUCCESSOR_PROBS)


def bigram_batch(seed: int, batch_size: int, seq_len: int, table: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` ``[batch, seq_len]``: sequences of the language, targets shifted by one."""
    successors, probs = table
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, successors.shape[0], (batch_size,), generator=gen)
    choices = torch.multinomial(probs, batch_size * seq_len, replacement=True, generator=gen).view(batch_size, seq_len)
    for t in range(seq_len):
        tokens[:, t + 1] = successors[tokens[:, t], choices[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


def entropy_floor() -> float:
    """The lowest reachable loss: the entropy of the successor distribution (nats)."""
    return -sum(p * math.log(p) for p in SUCCESSOR_PROBS)


class ThrottledStats(CommStats):
    """Byte counters that also sleep ``bytes / bandwidth`` per collective (a slow-network stand-in)."""

    def __init__(self, bytes_per_s: float) -> None:
        super().__init__()
        self.bytes_per_s = bytes_per_s
        self.slept = 0.0

    def record(self, op: str, purpose: str, sent: int) -> None:
        super().record(op, purpose, sent)
        self.slept += sent / self.bytes_per_s
        time.sleep(sent / self.bytes_per_s)


class DataParallelAdamW:
    """The baseline: average the gradients with one counted fp32 all-reduce, then torch's AdamW."""

    def __init__(self, params: list[torch.nn.Parameter], stats: CommStats, **kwargs: Any) -> None:
        self.params = [p for p in params if p.requires_grad]
        kwargs.setdefault("weight_decay", 0.0)  # torch's AdamW defaults to 0.01, the 1-bit optimizers (as DeepSpeed's) to 0
        self.optimizer = torch.optim.AdamW(self.params, foreach=False, **kwargs)
        self.comm = Collectives(None, stats)

    def step(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.comm.world > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.comm.all_reduce_sum_(flat, "full_precision")
            flat.div_(self.comm.world)
            for p, piece in zip(self.params, flat.split([p.numel() for p in self.params])):
                p.grad = piece.view_as(p).clone()
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def communication_stats(self) -> dict[str, Any]:
        return self.comm.stats.as_dict()


def build_model(work: Workload) -> torch.nn.Module:
    from dscompile.zoo import build

    case = build("gpt", seed=work.seed, vocab_size=VOCAB, seq_len=work.seq_len, d_model=work.d_model, n_layers=work.n_layers)
    return case.model


def build_optimizer(work: Workload, model: torch.nn.Module, stats: CommStats) -> Any:
    params = list(model.parameters())
    if work.optimizer == "adamw":
        return DataParallelAdamW(params, stats, **work.optimizer_args)
    if work.optimizer == "lamb":
        opt = OPTIMIZERS["onebitlamb"](params, **{**work.optimizer_args, "freeze_step": 10**9})
    else:
        opt = OPTIMIZERS[work.optimizer](params, **work.optimizer_args)
    opt.comm.stats = stats
    return opt


def lr_factor(work: Workload, step: int) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based)."""
    if step < work.lr_warmup_steps:
        return (step + 1) / work.lr_warmup_steps
    span = max(1, work.steps - 1 - work.lr_warmup_steps)
    return 1.0 - (1.0 - work.lr_final_fraction) * (step - work.lr_warmup_steps) / span


def eval_loss(model: torch.nn.Module, work: Workload) -> float:
    table = bigram_table(work.seed)
    with torch.no_grad():
        losses = [float(model(*bigram_batch(-1 - i, 16, work.seq_len, table))) for i in range(work.eval_batches)]
    return sum(losses) / len(losses)


def train_rank(rank: int, world: int, work: Workload) -> dict[str, Any]:
    """Train on this rank; return ``losses``, ``bytes`` and ``seconds`` per step, ``eval_loss``, ``stats``."""
    torch.manual_seed(work.seed)
    model = build_model(work)
    stats = ThrottledStats(work.bandwidth_bytes_per_s) if work.bandwidth_bytes_per_s else CommStats()
    opt = build_optimizer(work, model, stats)
    torch_opt = opt.optimizer if isinstance(opt, DataParallelAdamW) else opt
    peaks = [group["lr"] for group in torch_opt.param_groups]
    table = bigram_table(work.seed)
    losses, step_bytes, seconds = [], [], []
    for step in range(work.steps):
        inputs, targets = bigram_batch(1_000_003 * (step + 1) + rank, work.batch_size, work.seq_len, table)
        for group, peak in zip(torch_opt.param_groups, peaks):
            group["lr"] = peak * lr_factor(work, step)
        before = stats.total_bytes
        start = time.perf_counter()
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - start)
        step_bytes.append(stats.total_bytes - before)
        losses.append(loss.item())
    return {
        "losses": losses,
        "bytes": step_bytes,
        "seconds": seconds,
        "eval_loss": eval_loss(model, work),
        "stats": stats.as_dict(),
        "params": [p.detach().clone() for p in model.parameters()],
    }


ENGINE_TYPES = {"adamw": "AdamW", "onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb", "lamb": "OneBitLamb"}
"""``optimizer.type`` of each workload name through ``dscompile.initialize`` (``lamb``: 1-bit LAMB that never freezes)."""


def train_rank_engine(rank: int, world: int, work: Workload) -> dict[str, Any]:
    """``train_rank`` through ``dscompile.initialize``: the engine compiles the model and does the gradient
    communication (bytes per step: what this rank sent, from ``engine.comm_stats``). With
    ``bandwidth_bytes_per_s`` every step then sleeps ``bytes sent / bandwidth`` (counted in its time)."""
    torch.manual_seed(work.seed)
    model = build_model(work)
    params = dict(work.optimizer_args)
    if work.optimizer == "lamb":
        params["freeze_step"] = 10**9
    if work.optimizer == "adamw":
        params.setdefault("weight_decay", 0.0)  # as DataParallelAdamW
    config = {
        "train_micro_batch_size_per_gpu": work.batch_size,
        "optimizer": {"type": ENGINE_TYPES[work.optimizer], "params": params},
        "zero_optimization": {"stage": work.zero_stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = initialize(model=model, config=config)
    peaks = [group["lr"] for group in engine.optimizer.param_groups]
    table = bigram_table(work.seed)
    losses, step_bytes, seconds = [], [], []
    for step in range(work.steps):
        inputs, targets = bigram_batch(1_000_003 * (step + 1) + rank, work.batch_size, work.seq_len, table)
        for group, peak in zip(engine.optimizer.param_groups, peaks):
            group["lr"] = peak * lr_factor(work, step)
        before = bytes_sent(engine.comm_stats, world)
        start = time.perf_counter()
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        sent = bytes_sent(engine.comm_stats, world) - before
        if work.bandwidth_bytes_per_s:
            time.sleep(sent / work.bandwidth_bytes_per_s)
        seconds.append(time.perf_counter() - start)
        step_bytes.append(sent)
        losses.append(loss.item())
    return {
        "losses": losses,
        "bytes": step_bytes,
        "seconds": seconds,
        "eval_loss": eval_loss(model, work),
        "stats": {"total_bytes": sum(step_bytes), "bytes_by_purpose": engine.communication_stats()},
    }
