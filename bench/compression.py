"""Compression side by side: size, accuracy / loss and CPU inference latency of compressed models.

    python bench/compression.py [--teacher-steps 300] [--steps 120] [--models bert,gpt] [--no-torchao]

For a BERT-style classifier (the zoo's BERT on ``MarkerTask``: class accuracy) and a GPT-style LM
(the zoo's GPT on ``MarkovTask``: next-token accuracy, with the chain's entropy as the floor of the
eval loss), an fp32 teacher is trained, then each row compresses a copy of it:

- ``dscompile PTQ int8 / int4``: ``init_compression`` + ``redundancy_clean`` with no training;
- ``dscompile QAT int8 / int4``: ``--steps`` of quantization-aware training (int4 through DeepSpeed's
  bit schedule 8 -> 4), then ``redundancy_clean``;
- ``dscompile 50% FFN rows``: l1 row pruning of every FFN input layer (the output layer loses the
  matching columns), fine-tuned, cleaned: physically smaller matrices;
- ``dscompile layer reduction``: half the layers (teacher layers 1 and 3), distilled from the
  teacher's logits, cleaned;
- ``torchao int8 / int4``: torchao's weight-only post-training quantization (``quantize_`` with
  ``Int8WeightOnlyConfig`` / ``IntxWeightOnlyConfig(int4, group 32)``: torchao's Int4WeightOnlyConfig
  needs CUDA or the ``mslk`` package; on CPU its int4 values are stored unpacked in int8).
  Skipped with a message when torchao is not installed (``pip install torchao``).

Columns: saved ``state_dict`` bytes (and % of fp32), eval loss and accuracy on 512 held-out samples, and
the median forward latency of a batch on CPU, eager and compiled (dscompile's backend for fp32
and dscompile rows, Inductor for torchao). DeepSpeed's own compression library only simulated
quantization (its models stayed fp32-sized) and was removed in 0.19.8, so it has no row.
Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import copy
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dscompile.compression import get_compression_scheduler, init_compression, redundancy_clean
from dscompile.zoo import build
from dscompile.zoo.tasks import MarkerTask, MarkovTask

GROUPS = 64  # quantize_groups: divides every weight of both models (per-row or finer for most)


def saved_bytes(model: nn.Module) -> int:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


class Bench:
    """One model family: its task, teacher and metric."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name, self.args = name, args
        if name == "bert":
            self.task: Any = MarkerTask(vocab_size=128, seq_len=32, num_classes=4)
            self.make = lambda n_layers=4, seed=0: (
                build("bert", d_model=64, n_layers=n_layers, n_heads=4, vocab_size=128, seq_len=32, num_classes=4, seed=seed).model
            )
            self.ffn, self.ffn_out, self.prefix = r"layers\.\d+\.fc", r"layers\.\d+\.out", "layers"
            self.others = ["tok_emb", "pos_emb", "emb_norm", "pooler", "classifier"]
        else:
            self.task = MarkovTask(vocab_size=128, seq_len=32)
            self.make = lambda n_layers=4, seed=0: build("gpt", d_model=64, n_layers=n_layers, n_heads=4, vocab_size=128, seq_len=32, seed=seed).model
            self.ffn, self.ffn_out, self.prefix = r"mlp\.fc", r"mlp\.proj", "blocks"
            self.others = ["wte", "wpe", "ln_f"]
        gen = torch.Generator().manual_seed(1234)
        self.eval_batches = [self.task.batch(64, gen) for _ in range(8)]

    # -- training and evaluation --------------------------------------------------------------
    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def train(self, model: nn.Module, steps: int, lr: float, cfg: dict | None = None, teacher: nn.Module | None = None) -> None:
        model.train()
        compiled = torch.compile(model, backend="dscompile", options=cfg or {})
        scheduler = get_compression_scheduler(model) if cfg else None
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(7)
        for step in range(steps):
            if scheduler is not None:
                scheduler.step(step)
            inputs, targets = self.task.batch(self.args.batch, gen)
            logits = compiled(*inputs)
            loss = self.loss(logits, targets)
            if teacher is not None:
                with torch.no_grad():
                    soft = teacher(*inputs)
                loss = loss + F.kl_div(F.log_softmax(logits, -1), F.log_softmax(soft, -1), log_target=True, reduction="batchmean")
            loss.backward()
            if scheduler is not None:
                scheduler.after_backward()
            optimizer.step()
            optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step(steps)
        model.eval()

    @torch.no_grad()
    def metric(self, model: nn.Module) -> tuple[float, float]:
        """(eval loss, accuracy): next-token accuracy for the GPT, class accuracy for the BERT."""
        model.eval()
        losses, right, total = [], 0, 0
        for inputs, targets in self.eval_batches:
            logits = model(*inputs)
            losses.append(float(self.loss(logits, targets)))
            right += int((logits.argmax(-1) == targets).sum())
            total += targets.numel()
        return statistics.mean(losses), right / total

    @torch.no_grad()
    def latency(self, model: nn.Module, backend: str | None) -> float:
        model.eval()
        run = model if backend is None else torch.compile(model, backend=backend)
        inputs = self.eval_batches[0][0]
        for _ in range(3):
            run(*inputs)
        times = []
        for _ in range(self.args.repeats):
            start = time.perf_counter()
            run(*inputs)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    # -- compression recipes -------------------------------------------------------------------
    def quant_config(self, start: int, target: int, period: int = 1, in_forward: bool = True) -> dict:
        return {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_groups": GROUPS, "quantize_weight_in_forward": in_forward},
                    "different_groups": {"all": {"params": {"start_bits": start, "target_bits": target, "quantization_period": period}, "modules": ["*"]}},
                }
            }
        }

    def ptq(self, teacher: nn.Module, bits: int) -> nn.Module:
        model = copy.deepcopy(teacher)
        cfg = self.quant_config(bits, bits)
        init_compression(model, cfg)
        return redundancy_clean(model, cfg)

    def qat(self, teacher: nn.Module, bits: int) -> nn.Module:
        model = copy.deepcopy(teacher)
        steps = self.args.steps
        cfg = self.quant_config(8, bits, period=max(1, steps // 16), in_forward=False) if bits < 8 else self.quant_config(8, 8)
        init_compression(model, cfg)
        self.train(model, steps, self.args.lr / 3, cfg)
        return redundancy_clean(model, cfg)

    def row_pruning(self, teacher: nn.Module) -> nn.Module:
        model = copy.deepcopy(teacher)
        cfg = {
            "compression_training": {
                "row_pruning": {
                    "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "l1"},
                    "different_groups": {"ffn": {"params": {"dense_ratio": 0.5}, "modules": [self.ffn], "related_modules": [[self.ffn_out]]}},
                }
            }
        }
        init_compression(model, cfg)
        self.train(model, self.args.steps, self.args.lr / 3, cfg)
        return redundancy_clean(model, cfg)

    def layer_reduction(self, teacher: nn.Module) -> nn.Module:
        student = self.make(n_layers=2, seed=1)
        cfg = {
            "compression_training": {
                "layer_reduction": {
                    "enabled": True,
                    "keep_number_layer": 2,
                    "module_name_prefix": self.prefix,
                    "teacher_layer": [1, 3],
                    "other_module_name": self.others,
                }
            }
        }
        init_compression(student, cfg, teacher_model=teacher)
        teacher.eval()
        self.train(student, self.args.steps, self.args.lr / 3, None, teacher=teacher)
        return redundancy_clean(student, cfg)

    def torchao(self, teacher: nn.Module, bits: int) -> nn.Module:
        from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup

        model = copy.deepcopy(teacher)
        quantize_(model, Int8WeightOnlyConfig() if bits == 8 else IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
        return model


def have_torchao() -> bool:
    try:
        import torchao.quantization  # noqa: F401
    except ImportError:
        return False
    return True


def run(name: str, args: argparse.Namespace) -> list[dict]:
    bench = Bench(name, args)
    torch.manual_seed(0)
    teacher = bench.make()
    start = time.perf_counter()
    bench.train(teacher, args.teacher_steps, args.lr)
    print(f"[{name}] teacher trained in {time.perf_counter() - start:.0f}s: loss, accuracy {bench.metric(teacher)}", flush=True)
    fp32_bytes = saved_bytes(teacher)
    rows: list[tuple[str, Callable[[], nn.Module], str | None]] = [
        ("fp32", lambda: teacher, "dscompile"),
        ("dscompile PTQ int8", lambda: bench.ptq(teacher, 8), "dscompile"),
        ("dscompile PTQ int4", lambda: bench.ptq(teacher, 4), "dscompile"),
        ("dscompile QAT int8", lambda: bench.qat(teacher, 8), "dscompile"),
        ("dscompile QAT int4", lambda: bench.qat(teacher, 4), "dscompile"),
        ("dscompile 50% FFN rows", lambda: bench.row_pruning(teacher), "dscompile"),
        ("dscompile layer reduction 4->2", lambda: bench.layer_reduction(teacher), "dscompile"),
    ]
    if args.torchao and have_torchao():
        rows += [("torchao int8 (PTQ)", lambda: bench.torchao(teacher, 8), "inductor"), ("torchao int4 (PTQ)", lambda: bench.torchao(teacher, 4), "inductor")]
    elif args.torchao:
        print("torchao is not installed (pip install torchao): its rows are skipped", flush=True)
    results = []
    for label, make, backend in rows:
        torch._dynamo.reset()
        start = time.perf_counter()
        model = make()
        results.append(
            {
                "model": name,
                "variant": label,
                "bytes": saved_bytes(model),
                "fraction": saved_bytes(model) / fp32_bytes,
                "metric": bench.metric(model),
                "eager_ms": bench.latency(model, None),
                "compiled_ms": bench.latency(model, backend),
                "seconds": time.perf_counter() - start,
            }
        )
        r = results[-1]
        print(f"[{name}] {label}: {r['bytes']:,} B ({r['fraction']:.1%}), loss/acc {r['metric']}, {r['eager_ms']:.1f}/{r['compiled_ms']:.1f} ms", flush=True)
    if name == "gpt":
        print(f"[gpt] the Markov chain's entropy (the best reachable loss): {bench.task.entropy():.4f}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,gpt")
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-torchao", dest="torchao", action="store_false")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    results = [r for name in args.models.split(",") for r in run(name.strip(), args)]
    print()
    print("| model | variant | state_dict bytes | % of fp32 | eval loss | accuracy | eager ms/batch | compiled ms/batch |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        loss, accuracy = r["metric"]
        cells = [r["model"], r["variant"], f"{r['bytes']:,}", f"{r['fraction']:.1%}", f"{loss:.4f}", f"{accuracy:.3f}"]
        cells += [f"{r['eager_ms']:.2f}", f"{r['compiled_ms']:.2f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
