"""Goal 1: the default lowering against plain ``torch.compile(backend="inductor")``, ratio <= 1.0.

The zoo GPT (4 layers, d_model 512, batch 8 x 512) and an HF Llama from a config (~106M), each as a training
step (forward + backward, gradients dropped) and as a ``torch.no_grad()`` forward. Peers alternate. With
``--with-triton`` (and in the dry run) the zoo GPT's training step also runs dscompile's Triton codegen
(``lower: triton``, opt-in since Inductor became the default) to follow its gap to Inductor.
Each peer's loss (logits, for the forward) is compared with eager PyTorch's on the same batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from gpucheck.common import Ctx, alternate, free_memory, millions, per_round, timed_once

SECTION = "lowering"


def _case(ctx: Ctx, name: str) -> Any:
    from dscompile.zoo import build

    sizes = ctx.sizes.gpt if name == "gpt" else ctx.sizes.llama
    return build("gpt" if name == "gpt" else "hf_llama", seed=0, batch_size=ctx.sizes.batch, **sizes).to(ctx.device)


def _peers(ctx: Ctx, train: bool, with_triton: bool) -> dict[str, Callable[[torch.nn.Module], Any]]:
    peers = {
        "dscompile default": lambda m: torch.compile(m, backend="dscompile", options=ctx.dscompile_options()),
        "torch.compile": lambda m: torch.compile(m, backend=ctx.inductor),
    }
    if with_triton:
        peers["dscompile lower=triton"] = lambda m: torch.compile(m, backend="dscompile", options={"lower": "triton"})
    return peers


def _runner(model: torch.nn.Module, compiled: Any, batch: tuple, train: bool) -> Callable[[], torch.Tensor]:
    if train:

        def step() -> torch.Tensor:
            loss = compiled(*batch)
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return compiled(*batch[:-1])

    return forward


def _difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def run(ctx: Ctx) -> None:
    from dscompile.frontend import resolve_lowering

    ctx.table.add(SECTION, "default lowering", resolve_lowering(None), "what torch.compile(backend='dscompile') lowers with, no options")
    for model_name in ("gpt", "llama"):
        case = _case(ctx, model_name)
        batch = case.batch()
        params = sum(p.numel() for p in case.model.parameters())
        for train in (True, False):
            mode = "train step" if train else "no_grad forward"
            label = f"{model_name} ({millions(params)}) {mode}"
            if ctx.left() < 0:
                ctx.table.add(SECTION, label, "skipped", "section time spent")
                continue
            torch.manual_seed(0)
            reference = _runner(case.model, case.model, batch, train)()
            runners: dict[str, Callable[[], Any]] = {}
            for name, wrap in _peers(ctx, train, with_triton=ctx.with_triton and model_name == "gpt" and train).items():
                model = copy.deepcopy(case.model)
                run_fn = _runner(model, wrap(model), batch, train)
                torch.manual_seed(0)
                out, first = timed_once(run_fn, ctx)
                ctx.table.add(SECTION, f"{label}: {name} first call", f"{first:.1f} s", f"max |diff| vs eager {_difference(out, reference):.1e} (relative)")
                runners[name] = run_fn
            times = alternate(runners, ctx)
            for name, ms in times.items():
                ctx.table.add(SECTION, f"{label}: {name}", f"{sorted(ms)[len(ms) // 2]:.2f} ms", f"{len(ms)} rounds x {ctx.sizes.steps} calls")
            ctx.table.ratio(SECTION, f"{label}: dscompile default / torch.compile", per_round(times["dscompile default"], times["torch.compile"]),
                            target="<= 1.0", note="goal 1; lower is better")
            if "dscompile lower=triton" in times:
                ctx.table.ratio(SECTION, f"{label}: lower=triton / torch.compile", per_round(times["dscompile lower=triton"], times["torch.compile"]),
                                note="dscompile's Triton codegen (opt-in) against Inductor")
            del runners
            free_memory(ctx)
        del case
        free_memory(ctx)
