"""ZeroQuant and XTC on a BERT-style classifier, end to end on a CPU (DeepSpeed Compression's two recipes).

    python examples/compression/compress_bert.py --recipe zeroquant [--lkd]
    python examples/compression/compress_bert.py --recipe xtc

Both start from an fp32 teacher trained here (the zoo's 4-layer BERT on a synthetic task,
``dscompile.zoo.tasks.MarkerTask``) and end with a model that is really smaller, printed with its
accuracy and size.

ZeroQuant (``zeroquant.json``): post-training quantization with group-wise INT8 weights
(``quantize_groups``) and token-wise (dynamic) INT8 activations; no retraining. ``--lkd`` adds
ZeroQuant's layer-by-layer knowledge distillation: each quantized layer is trained alone to
reproduce the teacher layer's output on the teacher's own input hidden states (no labels, one
layer's activations in memory at a time).

XTC (``xtc.json``): extreme compression. Layer reduction keeps teacher layers 1 and 3 (``init_compression``
copies them into a 2-layer student), the transformer layers' weights are binarized (1 bit, XTC's
ternary variant: ``target_bits: 2``) with 8-bit activations, embeddings and head at 8 bits, and the
student is trained with the teacher's logits (knowledge distillation) through
``torch.compile(backend="dscompile")``, the compression schedule driven step by step.

Either way ``redundancy_clean`` stores the weights packed (binary weights in 2-bit codes: a pruned
zero is a third level) and the cleaned layers run dscompile's quantized matmul.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dscompile.compression import get_compression_scheduler, init_compression, redundancy_clean
from dscompile.zoo import build
from dscompile.zoo.tasks import MarkerTask

HERE = Path(__file__).resolve().parent
TASK = MarkerTask(vocab_size=128, seq_len=32, num_classes=4)


def make_bert(n_layers: int, seed: int = 0) -> nn.Module:
    return build("bert", d_model=64, n_layers=n_layers, n_heads=4, vocab_size=128, seq_len=32, num_classes=4, seed=seed).model


def saved_bytes(model: nn.Module) -> int:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


@torch.no_grad()
def accuracy(model: nn.Module, batches: list) -> float:
    model.eval()
    right = sum(int((model(*inputs).argmax(-1) == labels).sum()) for inputs, labels in batches)
    return right / sum(labels.numel() for _, labels in batches)


def train(model: nn.Module, steps: int, lr: float, config: dict | None = None, teacher: nn.Module | None = None, batch: int = 32) -> None:
    """Train through dscompile; with a compression ``config`` the schedule advances every step,
    with a ``teacher`` the loss adds the KL divergence to its logits."""
    model.train()
    compiled = torch.compile(model, backend="dscompile", options=config or {})
    scheduler = get_compression_scheduler(model) if config else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(3)
    for step in range(steps):
        if scheduler is not None:
            scheduler.step(step)
        inputs, labels = TASK.batch(batch, gen)
        logits = compiled(*inputs)
        loss = F.cross_entropy(logits, labels)
        if teacher is not None:
            with torch.no_grad():
                target = teacher(*inputs)
            loss = loss + F.kl_div(F.log_softmax(logits, -1), F.log_softmax(target, -1), log_target=True, reduction="batchmean")
        loss.backward()
        if scheduler is not None:
            scheduler.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0:
            print(f"  step {step}: loss {float(loss.detach()):.4f}", flush=True)
    model.eval()


def layerwise_distillation(student: nn.Module, teacher: nn.Module, config: dict, steps: int, lr: float) -> None:
    """ZeroQuant's LKD: train each quantized layer to match the teacher layer on the teacher's inputs."""
    teacher.eval()
    gen = torch.Generator().manual_seed(5)
    for index, (s_layer, t_layer) in enumerate(zip(student.layers, teacher.layers)):
        captured: dict[str, tuple] = {}
        handle = t_layer.register_forward_pre_hook(lambda module, args, captured=captured: captured.__setitem__("args", args))
        compiled = torch.compile(s_layer, backend="dscompile", options=config)  # the quantize pass sees this layer's weights
        optimizer = torch.optim.AdamW(s_layer.parameters(), lr=lr, weight_decay=0.0)
        s_layer.train()
        for _ in range(steps):
            inputs, _ = TASK.batch(32, gen)
            with torch.no_grad():
                teacher(*inputs)
                hidden, key_mask = captured["args"]
                target = t_layer(hidden, key_mask)
            loss = F.mse_loss(compiled(hidden, key_mask), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        handle.remove()
        print(f"  LKD layer {index}: mse {float(loss):.2e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=("zeroquant", "xtc"), required=True)
    parser.add_argument("--lkd", action="store_true", help="ZeroQuant: layer-by-layer knowledge distillation")
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=200, help="XTC distillation steps / LKD steps per layer")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save", type=Path, help="write the cleaned state_dict here")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    gen = torch.Generator().manual_seed(99)
    eval_batches = [TASK.batch(64, gen) for _ in range(8)]

    print("training the fp32 teacher", flush=True)
    torch.manual_seed(0)
    teacher = make_bert(4)
    train(teacher, args.teacher_steps, args.lr)
    rows = [("fp32 teacher (4 layers)", saved_bytes(teacher), accuracy(teacher, eval_batches))]

    config = json.loads((HERE / f"{args.recipe}.json").read_text())
    if args.recipe == "zeroquant":
        student = copy.deepcopy(teacher)
        init_compression(student, config)
        if args.lkd:
            layerwise_distillation(student, teacher, config, args.steps, args.lr / 10)
        compiled = torch.compile(student, backend="dscompile", options=config)
        rows.append(("ZeroQuant W8A8, compressed graph" + (" + LKD" if args.lkd else ""), saved_bytes(student), accuracy(compiled, eval_batches)))
    else:
        student = make_bert(2, seed=1)
        init_compression(student, config, teacher_model=teacher)  # layer reduction: teacher layers 1, 3
        rows.append(("XTC student before training", saved_bytes(student), accuracy(torch.compile(student, backend="dscompile", options=config), eval_batches)))
        print("distilling the binarized 2-layer student", flush=True)
        train(student, args.steps, args.lr / 3, config, teacher=teacher)
    redundancy_clean(student, config)
    label = "ZeroQuant cleaned (int8 weights + int8 activations)" if args.recipe == "zeroquant" else "XTC cleaned (2 layers, binary weights)"
    rows.append((label, saved_bytes(student), accuracy(student, eval_batches)))
    if args.save:
        torch.save(student.state_dict(), args.save)
    print()
    print(f"{'model':58s} {'bytes':>10s} {'x smaller':>10s} {'accuracy':>9s}")
    for name, size, acc in rows:
        print(f"{name:58s} {size:10,d} {rows[0][1] / size:10.2f} {acc:9.3f}")


if __name__ == "__main__":
    main()
