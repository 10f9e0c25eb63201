"""What ``dscompile compress TARGET --config F`` measures: sizes before and after, and output error.

The model is compressed as the config says with the schedule at its end (every technique on,
``target_bits`` reached, masks decided from the current weights: post-training compression), run
through the compression passes (``torch.compile(backend="dscompile")``, the fake-quantized and
masked model), then cleaned with ``redundancy_clean``. Sizes are the bytes of the saved
``state_dict``; errors are the largest absolute output differences on the sample inputs.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dscompile.compression import get_compression_scheduler, init_compression
from dscompile.passes.redundancy_clean import clean_model
from dscompile.runtime.compression import packed_bytes


def saved_bytes(model: nn.Module) -> int:
    """Bytes of ``torch.save(model.state_dict())``."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


def first_tensor(output: Any) -> torch.Tensor:
    """The tensor to compare from a model's output (a tensor, ``.logits``, or the first tensor)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else []
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"cannot find a tensor in the model's output ({type(output).__name__})")


@dataclass
class CompressReport:
    fp32_bytes: int
    cleaned_bytes: int
    packed_weight_bytes: int
    error_vs_fp32: float
    error_vs_compressed_graph: float
    reference_scale: float
    final_step: int
    layers: dict[str, str] = field(default_factory=dict)

    def render(self) -> str:
        ratio = self.cleaned_bytes / self.fp32_bytes
        lines = [
            f"state_dict bytes: {self.fp32_bytes:,} fp32 -> {self.cleaned_bytes:,} cleaned ({ratio:.1%}, {1 / ratio:.2f}x smaller)",
            f"packed weights (codes + scales): {self.packed_weight_bytes:,} bytes",
            f"max |output| fp32: {self.reference_scale:.4g}",
            f"max output error vs fp32: {self.error_vs_fp32:.4g}",
            f"max output error vs the compressed training graph (schedule at step {self.final_step}): {self.error_vs_compressed_graph:.3g}",
            "layers:",
        ]
        lines += [f"  {name}: {what}" for name, what in self.layers.items()]
        return "\n".join(lines)


def compress_report(model: nn.Module, inputs: tuple, config: Any, save: str | Path | None = None) -> CompressReport:
    """Compress ``model`` with ``config`` (see the module docstring) and measure it."""
    model.eval()
    fp32_bytes = saved_bytes(model)
    with torch.no_grad():
        fp32 = first_tensor(model(*inputs)).float()
    init_compression(model, config)
    scheduler = get_compression_scheduler(model)
    final = scheduler.final_step()
    scheduler.step(final)
    torch._dynamo.reset()
    with torch.no_grad():
        compressed = first_tensor(torch.compile(model, backend="dscompile", options=config)(*inputs)).float()
    cleaning = clean_model(model)  # redundancy_clean's work, with its per-layer report
    torch._dynamo.reset()
    with torch.no_grad():
        cleaned = first_tensor(model(*inputs)).float()
    if save is not None:
        torch.save(model.state_dict(), save)
    return CompressReport(
        fp32_bytes=fp32_bytes,
        cleaned_bytes=saved_bytes(model),
        packed_weight_bytes=packed_bytes(model),
        error_vs_fp32=float((cleaned - fp32).abs().max()),
        error_vs_compressed_graph=float((cleaned - compressed).abs().max()),
        reference_scale=float(fp32.abs().max()),
        final_step=final,
        layers=dict(cleaning["layers"]),
    )
