"""Per-layer compression state: what the compression passes read in the graph, the schedule writes.

``init_compression`` gives every compressed layer a ``CompressionState`` child (``layer.ds_compression``)
and points the layer's weight at it (``weight.ds_compression``), which is how the graph passes find
it from a parameter of the captured graph. The state holds tensors only (so they live in the
model's ``state_dict`` and move with ``.to()``): the current bit width, 0/1 switches per technique,
masks, learned mask scores (parameters the optimizer trains) and the calibrated activation range.
The passes read them as inputs of the compiled graph (``dscompile.graph.lift_tensor``), so the
schedule changes them between steps in place, without a recompile. ``set_step`` is the schedule:
a pure function of the global step (plus, for snip_momentum masks, the accumulated scores when the
decision is taken). As in DeepSpeed, every switch is off until the schedule's first ``set_step``,
and ``l1`` masks are decided from the weights when the layer is prepared.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from dscompile.kernels.masks import topk_mask
from dscompile.kernels.quantize import fake_quantize

log = logging.getLogger("dscompile.compression")

MASK_TECHNIQUES = ("sparse", "row", "head", "channel")
SNIP_MOMENTUM = 0.9
PREPARED = "ds_compression_prepared"
"""The mark every parameter of a prepared model carries (catches a config whose model was never prepared)."""


@dataclass(frozen=True)
class WeightQuantSpec:
    """Weight quantization of one layer (DeepSpeed's group ``params`` plus the shared parameters).

    ``in_forward`` (DeepSpeed's ``quantize_weight_in_forward``) quantizes to ``target_bits`` from
    ``offset`` on; otherwise (MoQ) the bits start at ``start_bits`` and drop by one each time the
    quantization count reaches the period, which then doubles: with ``k`` the number of steps since
    ``offset`` (counting that one), bits = ``start - #{i >= 0: period * 2**i <= k}``, never below target.
    ``period`` 0 (DeepSpeed's examples use it) drops one bit at every quantization: bits = ``start - k``.
    """

    group: str
    start_bits: int
    target_bits: int
    period: int
    offset: int
    in_forward: bool
    symmetric: bool
    stochastic: bool
    num_groups: int
    mix_real: bool
    change_ratio: float
    verbose: bool = False

    def calls(self, step: int) -> int:
        """DeepSpeed's quantization count for the forward of ``step`` (0 while off)."""
        return step - self.offset + 1 if step >= self.offset else 0

    def drops(self, calls: int) -> int:
        if self.period == 0:
            return min(self.start_bits - self.target_bits, calls)
        if calls < self.period:
            return 0
        return min(self.start_bits - self.target_bits, int(math.floor(math.log2(calls / self.period))) + 1)

    def drop_call(self, drop: int) -> int:
        """The quantization count at which bit drop number ``drop`` (1-based) happens."""
        return drop if self.period == 0 else self.period * 2 ** (drop - 1)

    def bits_at(self, step: int) -> int | None:
        """The bit width the forward of ``step`` uses, None before ``offset``."""
        k = self.calls(step)
        if k == 0:
            return None
        if self.in_forward:
            return self.target_bits
        return self.start_bits - self.drops(k)

    def real_ratio_at(self, step: int) -> float:
        """``fp16_mixed_quantize``'s share of the unquantized weight: 1 at the last bit change, then
        falling by ``change_ratio`` per step, down to 0."""
        if not self.mix_real:
            return 0.0
        k = self.calls(step)
        d = self.drops(k)
        last_change = self.drop_call(d) if d > 0 else 0
        return max(0.0, 1.0 - self.change_ratio * (k - last_change))

    def reachable_bits(self) -> range:
        return range(self.target_bits, self.target_bits + 1) if self.in_forward else range(self.target_bits, self.start_bits + 1)


@dataclass(frozen=True)
class ActQuantSpec:
    """Activation quantization of one layer's input: ``static`` calibrates one range with momentum
    0.95 during training, else each token (Linear) or sample (Conv2d) gets its own range."""

    bits: int
    symmetric: bool
    static: bool
    offset: int
    per: str
    momentum: float = 0.95


@dataclass(frozen=True)
class MaskSpec:
    """One pruning technique on one layer. ``technique``: sparse (elements), row (output rows of a
    Linear), head (the input columns of an attention output projection, grouped in ``num_heads``),
    channel (output channels of a Conv2d). ``method``: l1 | topk | snip_momentum."""

    technique: str
    method: str
    dense_ratio: float
    offset: int
    offset_end: int
    num_heads: int = 0
    block: tuple[int, int] = (1, 1)
    stride: int = 1

    def active(self, step: int) -> bool:
        return step >= self.offset


def _scores_shape(technique: str, weight: torch.Tensor, spec: MaskSpec) -> tuple[int, ...]:
    """DeepSpeed's shapes for learned (topk) scores."""
    if technique == "sparse":
        return tuple(weight.shape)
    if technique == "row":
        return (weight.shape[0], 1)
    if technique == "head":
        return (1, spec.num_heads)
    return (weight.shape[0], 1, 1, 1)


def _mask_shape(technique: str, weight: torch.Tensor, spec: MaskSpec) -> tuple[int, ...]:
    if technique == "sparse":
        return tuple(weight.shape)
    if technique == "head":
        return (spec.num_heads,)
    return (weight.shape[0],)


def draw_scores(technique: str, weight: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """Learned mask scores as DeepSpeed draws them: kaiming-uniform (a = sqrt(5)) in its shape, on the weight's device."""
    scores = torch.empty(_scores_shape(technique, weight, spec), device=weight.device, dtype=torch.float32)
    nn.init.kaiming_uniform_(scores, a=math.sqrt(5))
    return scores


class CompressionState(nn.Module):
    """The tensors the compression passes read for one layer (see the module docstring)."""

    def __init__(
        self,
        layer_name: str,
        kind: str,
        weight: torch.Tensor,
        weight_quant: WeightQuantSpec | None = None,
        act_quant: ActQuantSpec | None = None,
        masks: dict[str, MaskSpec] | None = None,
        related: dict[str, list[str]] | None = None,
        scores: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``scores``: the learned (``topk``) mask scores per technique, drawn by the caller in
        DeepSpeed's order (``scores_like_deepspeed``); missing ones are drawn here."""
        super().__init__()
        self.layer_name = layer_name
        self.kind = kind
        self.weight_quant = weight_quant
        self.act_quant = act_quant
        self.masks = dict(masks or {})
        self.related = dict(related or {})
        self.sharers: list[str] = [layer_name]
        device = weight.device
        scalar = lambda v: torch.tensor(float(v), device=device)  # noqa: E731
        if weight_quant is not None:
            self.register_buffer("wq_bits", scalar(weight_quant.start_bits))
            self.register_buffer("wq_on", scalar(0))
            self.register_buffer("wq_ratio", scalar(1))
        if act_quant is not None:
            self.register_buffer("aq_on", scalar(0))
            if act_quant.static:
                self.register_buffer("aq_range", torch.zeros(2, device=device))
        for technique, spec in self.masks.items():
            self.register_buffer(f"{technique}_on", scalar(0))
            if spec.method == "topk":
                drawn = (scores or {}).get(technique)
                self.register_parameter(f"{technique}_scores", nn.Parameter(drawn if drawn is not None else draw_scores(technique, weight, spec)))
            elif spec.method == "snip_momentum":
                self.register_buffer(f"{technique}_mask", torch.ones(_mask_shape(technique, weight, spec), device=device))
                rows, cols = spec.block
                flat = weight.reshape(weight.shape[0], -1)
                self.register_buffer("sparse_snip_scores", torch.zeros(flat.shape[0] // rows, flat.shape[1] // cols, device=device))
            else:  # l1: decided from the weights now, as DeepSpeed's enable_*_pruning does
                self.register_buffer(f"{technique}_mask", torch.ones(_mask_shape(technique, weight, spec), device=device))
                with torch.no_grad():
                    getattr(self, f"{technique}_mask").copy_(self.l1_mask(technique, weight))

    # -- the schedule -------------------------------------------------------------------------
    @torch.no_grad()
    def set_step(self, step: int, weight: torch.Tensor) -> None:
        """Set every switch, bit width, ratio and snip_momentum mask for the forward of ``step``."""
        wq = self.weight_quant
        if wq is not None:
            bits = wq.bits_at(step)
            if bits is not None and wq.verbose and int(self.wq_bits) != bits:
                log.info("%s: weight quantization at %d bits from step %d", self.layer_name, bits, step)
            self.wq_on.fill_(0 if bits is None else 1)
            self.wq_bits.fill_(wq.start_bits if bits is None else bits)
            self.wq_ratio.fill_(wq.real_ratio_at(step))
        if self.act_quant is not None:
            self.aq_on.fill_(1 if step >= self.act_quant.offset else 0)
        for technique, spec in self.masks.items():
            on = spec.active(step)
            getattr(self, f"{technique}_on").fill_(1 if on else 0)
            if on and spec.method == "snip_momentum" and step <= spec.offset_end and (step - spec.offset) % spec.stride == 0:
                self.sparse_mask.copy_(self._snip_mask(step, spec, weight))

    def l1_mask(self, technique: str, weight: torch.Tensor) -> torch.Tensor:
        """Keep the largest-magnitude elements / rows / heads / channels (DeepSpeed's l1 scores)."""
        spec = self.masks[technique]
        w = weight.detach().float()
        if technique == "sparse":
            scores = w.abs()
        elif technique == "row":
            scores = torch.linalg.norm(w, ord=1, dim=1)
        elif technique == "head":
            columns = w.shape[1]
            scores = w.abs().reshape(w.shape[0], spec.num_heads, columns // spec.num_heads).sum(dim=(0, 2))
        else:
            scores = torch.linalg.norm(w.reshape(w.shape[0], -1), ord=1, dim=1)
        return topk_mask(scores, spec.dense_ratio)

    def _snip_mask(self, step: int, spec: MaskSpec, weight: torch.Tensor) -> torch.Tensor:
        """Blocks with the highest accumulated ``|w * grad|`` survive; sparsity rises cubically."""
        span = spec.offset_end - spec.offset
        progress = 1.0 if span == 0 else min(1.0, (step - spec.offset) / span)
        sparsity = (1 - spec.dense_ratio) * (1 - (1 - progress) ** 3)
        rows, cols = spec.block
        keep_blocks = topk_mask(self.sparse_snip_scores, 1 - sparsity)
        mask = keep_blocks.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
        return mask.reshape(weight.shape)

    @torch.no_grad()
    def accumulate_snip(self, weight: torch.Tensor, step: int) -> None:
        """After a backward: ``scores <- 0.9 * scores + sum over each block of |w * grad|``."""
        spec = self.masks.get("sparse")
        if spec is None or spec.method != "snip_momentum" or weight.grad is None or step > spec.offset_end:
            return
        rows, cols = spec.block
        flat = (weight.detach() * weight.grad.detach()).abs().reshape(weight.shape[0], -1).float()
        blocks = flat.reshape(flat.shape[0] // rows, rows, flat.shape[1] // cols, cols).sum(dim=(1, 3))
        self.sparse_snip_scores.mul_(SNIP_MOMENTUM).add_(blocks)

    # -- what the graph computes, in eager (redundancy_clean uses it) ----------------------------
    def mask(self, technique: str) -> torch.Tensor:
        """The current mask of a technique (topk: of the learned scores): the weight's shape for
        sparse, one entry per row / head / channel otherwise."""
        spec = self.masks[technique]
        if spec.method == "topk":
            scores = getattr(self, f"{technique}_scores").detach()
            mask = topk_mask(scores, spec.dense_ratio)
            return mask if technique == "sparse" else mask.reshape(-1)
        return getattr(self, f"{technique}_mask").detach().clone()

    def enabled(self, technique: str) -> bool:
        name = {"weight_quant": "wq_on", "act_quant": "aq_on"}.get(technique, f"{technique}_on")
        return hasattr(self, name) and bool(getattr(self, name) > 0)

    def quantized_weight(self, weight: torch.Tensor, bits: int) -> torch.Tensor:
        """``weight`` fake-quantized at ``bits`` (nearest rounding: what ``redundancy_clean`` stores)."""
        wq = self.weight_quant
        assert wq is not None
        return fake_quantize(weight.detach(), bits, wq.num_groups, wq.symmetric)

    def extra_repr(self) -> str:
        parts = []
        if self.weight_quant is not None:
            parts.append(f"weight {self.weight_quant.start_bits}->{self.weight_quant.target_bits} bits")
        if self.act_quant is not None:
            parts.append(f"activations {self.act_quant.bits} bits")
        parts += [f"{t} {s.method} {s.dense_ratio}" for t, s in self.masks.items()]
        return f"{self.layer_name}: " + ", ".join(parts)


def state_of(tensor: torch.Tensor) -> CompressionState | None:
    """The compression state a weight parameter points at (set by ``init_compression``)."""
    state = getattr(tensor, "ds_compression", None)
    return state if isinstance(state, CompressionState) else None
