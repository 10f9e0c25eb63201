"""The README's demo: a small GPT trained with ``backend="dscompile"`` next to eager PyTorch.

It shows the point of dscompile in one screen: the compiled model trains to the same losses as
eager PyTorch, and every pass of the pipeline is visible (nodes, collectives, FLOPs, memory,
time per pass). Compiling is most of its run time, so it reports what is being compiled while it
happens; Inductor's on-disk caches make later runs faster.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import tempfile
import threading
import time
from typing import TextIO

import torch

from dscompile.dump import print_summaries

DEMO_MODEL = {"n_layers": 1, "d_model": 32, "n_heads": 4, "seq_len": 16, "vocab_size": 128}


class CompileProgress:
    """Prints what the compiler is doing and for how long, while it does it.

    On a terminal one status line is rewritten every half second; otherwise (a pipe, a CI log) a
    line is printed when the phase changes. ``phase`` is set by the demo (Dynamo's capture) and by
    the frontend's ``compile_progress`` events.
    """

    def __init__(self, out: TextIO = sys.stdout, interval: float = 0.5) -> None:
        self.out = out
        self.interval = interval
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.phase = ""
        self.phase_start = self.start
        self.timings: list[tuple[str, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def set(self, phase: str) -> None:
        with self._lock:
            now = time.perf_counter()
            if self.phase:
                self.timings.append((self.phase, now - self.phase_start))
            self.phase, self.phase_start = phase, now
            if not self.tty:
                print(f"  [{self.elapsed():6.1f} s] {phase}", file=self.out, flush=True)
            else:
                self._draw()

    def on_event(self, graph: str, phase: str) -> None:
        self.set(f"{graph}: {phase}")

    def _draw(self) -> None:
        line = f"  [{self.elapsed():6.1f} s] {self.phase}"
        self.out.write("\r" + line[:110].ljust(110))
        self.out.flush()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                self._draw()

    def __enter__(self) -> CompileProgress:
        if self.tty:
            self._thread = threading.Thread(target=self._tick, name="dscompile-demo-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self.phase:
                self.timings.append((self.phase, time.perf_counter() - self.phase_start))
                self.phase = ""
            if self.tty:
                self.out.write("\r" + " " * 110 + "\r")
                self.out.flush()


def _cache_note() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return f"Inductor's compile cache: {cache_dir()} (later runs reuse it)"


def run_demo(steps: int = 5, lower: str | None = None, seed: int = 0, out: TextIO = sys.stdout) -> dict[str, list[float]]:
    """Train a one-layer zoo GPT for ``steps`` AdamW steps eagerly and compiled; print losses, then the pass-by-pass summary."""
    from dscompile.frontend import compile_progress, resolve_lowering
    from dscompile.zoo import build, make_batch

    torch.manual_seed(seed)
    case = build("gpt", **DEMO_MODEL)
    eager_model = case.model
    compiled_source = copy.deepcopy(eager_model)
    options: dict = {}
    if lower:
        options["lower"] = lower
    lowering = resolve_lowering(lower)
    with tempfile.TemporaryDirectory(prefix="dscompile-demo-") as dump_dir:
        options["dump"] = dump_dir
        compiled = torch.compile(compiled_source, backend="dscompile", options=options)
        eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
        compiled_opt = torch.optim.AdamW(compiled_source.parameters(), lr=1e-3)
        losses: dict[str, list[float]] = {"eager": [], "dscompile": []}
        params = sum(p.numel() for p in eager_model.parameters())
        print(f"GPT-style model ({DEMO_MODEL['n_layers']} layer, d_model {DEMO_MODEL['d_model']}, {params:,} parameters), "
              f"{steps} AdamW steps, eager PyTorch vs torch.compile(backend='dscompile'), lowering: {lowering}", file=out)
        print(f"Step 0 compiles the forward and backward graphs ({_cache_note()}):", file=out, flush=True)
        rows = []
        for step in range(steps):
            *inputs, targets = make_batch(case, seed=step)
            times = {}
            for name, model, opt in (("eager", eager_model, eager_opt), ("dscompile", compiled, compiled_opt)):
                progress = CompileProgress(out) if name == "dscompile" and step == 0 else None
                start = time.perf_counter()
                with contextlib.ExitStack() as stack:
                    if progress:
                        stack.enter_context(progress)
                        stack.enter_context(compile_progress(progress.on_event))
                        progress.set("Dynamo: capturing the model's graph")
                    loss = model(*inputs, targets)
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[name].append(loss.item())
                times[name] = time.perf_counter() - start
                if progress:
                    print(f"  compiled in {times[name]:.1f} s; slowest phases: "
                          + ", ".join(f"{phase} {sec:.1f} s" for phase, sec in sorted(progress.timings, key=lambda t: -t[1])[:3]), file=out)
            rows.append((step, losses["eager"][-1], losses["dscompile"][-1], times["dscompile"]))
        print(f"\n{'step':>4}  {'eager loss':>12}  {'dscompile loss':>14}  {'|diff|':>10}  {'dscompile s':>11}", file=out)
        for step, eager_loss, compiled_loss, seconds in rows:
            print(f"{step:>4}  {eager_loss:>12.6f}  {compiled_loss:>14.6f}  {abs(eager_loss - compiled_loss):>10.2e}  {seconds:>11.3f}", file=out)
        print("\nPass-by-pass summary (nodes, collectives, estimated MFLOP, peak live MB, pass time):", file=out)
        print(print_summaries(dump_dir), file=out)
    return losses

