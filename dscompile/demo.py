"""The README's demo: a small GPT trained with ``backend="dscompile"`` next to eager PyTorch."""

from __future__ import annotations

import copy
import tempfile
import time

import torch

from dscompile.dump import print_summaries


def run_demo(steps: int = 5, lower: str | None = None, seed: int = 0) -> dict[str, list[float]]:
    """Train the zoo's GPT for ``steps`` steps both ways; print losses and the pass-by-pass summary."""
    from dscompile.zoo import build, make_batch

    torch.manual_seed(seed)
    case = build("gpt")
    eager_model = case.model
    compiled_source = copy.deepcopy(eager_model)
    options: dict = {}
    if lower:
        options["lower"] = lower
    with tempfile.TemporaryDirectory(prefix="dscompile-demo-") as dump_dir:
        options["dump"] = dump_dir
        compiled = torch.compile(compiled_source, backend="dscompile", options=options)
        eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
        compiled_opt = torch.optim.AdamW(compiled_source.parameters(), lr=1e-3)
        losses: dict[str, list[float]] = {"eager": [], "dscompile": []}
        print(f"GPT-style model, {sum(p.numel() for p in eager_model.parameters()):,} parameters; {steps} AdamW steps")
        print(f"{'step':>4}  {'eager loss':>12}  {'dscompile loss':>14}  {'|diff|':>10}  {'dscompile s':>11}")
        for step in range(steps):
            *inputs, targets = make_batch(case, seed=step)
            for name, model, opt in (("eager", eager_model, eager_opt), ("dscompile", compiled, compiled_opt)):
                start = time.perf_counter()
                loss = model(*inputs, targets)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[name].append(loss.item())
                elapsed = time.perf_counter() - start
            diff = abs(losses["eager"][-1] - losses["dscompile"][-1])
            print(f"{step:>4}  {losses['eager'][-1]:>12.6f}  {losses['dscompile'][-1]:>14.6f}  {diff:>10.2e}  {elapsed:>11.3f}")
        print("\nPass-by-pass summary (nodes, collectives, estimated MFLOP, peak live MB, pass time):")
        print(print_summaries(dump_dir))
    return losses
