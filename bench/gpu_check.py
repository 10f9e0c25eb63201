"""The GPU check: GPU-marked tests plus the GPU timings the README and benchmarks promise, one table.

    python bench/gpu_check.py                 # on a machine with one CUDA GPU; <= 8 minutes
    python bench/gpu_check.py --cpu-dry-run   # tiny sizes on a CPU (Triton in its interpreter): proves the script runs

Rows:

- ``tests``: ``pytest -m gpu`` (tests that need CUDA; skipped elsewhere), passed / failed / skipped;
- ``lowering``: a training step (forward + backward) of the zoo GPT, ms, for eager PyTorch,
  dscompile's Triton lowering (the GPU default), dscompile's Inductor lowering and plain
  ``torch.compile(backend="inductor")``; the loss of each against eager's;
- ``sparse attention``: forward + backward of BigBird block-sparse attention (the op's default
  kernel: Triton on a GPU) against dense SDPA and FlexAttention with the same block mask, at
  4k, 8k and 16k tokens, ms and peak memory;
- ``zero3 bf16``: one ZeRO-3 + bf16 training step of the GPT on one rank over NCCL (gloo in the
  dry run), ms and peak memory;
- ``inference kernels``: the Triton cache attention (decode: 1 query, GQA, a cache of ``slots``
  slots filled to two lengths; and a prefill) against the op's torch path and plain SDPA over the
  repeated cache, and the Triton rotary against the torch path (bit-equal or not), ms and the
  largest difference; then a decode step (cache write, rotary, cache attention) captured in a CUDA
  graph with ``torch.cuda.graph`` and replayed at several positions against eager (CUDA only).

Each section runs only while the time budget (``--budget``, default 450 s) lasts; a skipped
section says so in the table. Times are the median of ``--repeats`` calls after warm-up (compile)
calls; on a CPU they measure nothing about a GPU and are printed only to show the script works.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Sizes:
    """Problem sizes of a real run and of the CPU dry run."""

    gpt: dict[str, int]
    batch: int
    seqs: list[int]
    heads: int
    head_dim: int
    block: int
    repeats: int
    decode: dict[str, int] = field(default_factory=dict)


GPU_SIZES = Sizes(gpt={"seq_len": 512, "d_model": 512, "n_heads": 8, "n_layers": 4, "vocab_size": 8192}, batch=8,
                  seqs=[4096, 8192, 16384], heads=8, head_dim=64, block=64, repeats=10,
                  decode={"batch": 4, "heads": 32, "kv_heads": 8, "dim": 128, "slots": 4096, "prefill": 1024})
DRY_SIZES = Sizes(gpt={"seq_len": 16, "d_model": 32, "n_heads": 2, "n_layers": 1, "vocab_size": 64}, batch=2,
                  seqs=[128, 256], heads=2, head_dim=16, block=32, repeats=2,
                  decode={"batch": 2, "heads": 4, "kv_heads": 2, "dim": 16, "slots": 40, "prefill": 8})


@dataclass
class Table:
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)

    def add(self, section: str, case: str, value: str, note: str = "") -> None:
        self.rows.append((section, case, value, note))
        print(f"  {section:18} {case:34} {value:>22}  {note}", flush=True)

    def render(self) -> str:
        widths = [max(len(r[i]) for r in [("section", "case", "value", "note"), *self.rows]) for i in range(4)]
        lines = [" | ".join(h.ljust(w) for h, w in zip(("section", "case", "value", "note"), widths))]
        lines.append("-+-".join("-" * w for w in widths))
        lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in self.rows]
        return "\n".join(lines)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> tuple[float, float | None]:
    """(median ms over ``repeats`` calls after ``warmup`` calls, peak MiB of one call on CUDA)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), peak


def _mem(peak: float | None) -> str:
    return f"peak {peak:.0f} MiB" if peak is not None else ""


# ----------------------------------------------------------------------------------------- sections


def run_gpu_tests(table: Table, timeout: float) -> None:
    try:
        import pytest  # noqa: F401
    except ImportError:
        table.add("tests", "pytest -m gpu", "not run", "pytest missing: pip install -e '.[test]'")
        return
    start = time.perf_counter()
    # only the modules holding gpu-marked tests: collecting the whole suite costs a minute
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--tb=short", "--show-capture=no", "-p", "no:cacheprovider", "-m", "gpu", *files],
                          cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 30))
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-200:]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", summary)}
    value = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "skipped"))
    ok = proc.returncode in (0, 5) and not counts.get("failed") and not counts.get("error") and not counts.get("errors")
    table.add("tests", "pytest -m gpu", value, f"{time.perf_counter() - start:.0f} s" + ("" if ok else f"; FAILED (exit {proc.returncode})"))
    if not ok:
        print(proc.stdout[-12000:], proc.stderr[-2000:], sep="\n")


def run_lowering(table: Table, sizes: Sizes, device: torch.device) -> None:
    from dscompile.zoo import build, make_batch

    case = build("gpt", seed=0, batch_size=sizes.batch, **sizes.gpt).to(device)
    batch = make_batch(case, seed=1)
    variants: dict[str, Callable[[torch.nn.Module], Any]] = {
        "eager": lambda m: m,
        "dscompile lower=triton": lambda m: torch.compile(m, backend="dscompile", options={"lower": "triton"}),
        "dscompile lower=inductor": lambda m: torch.compile(m, backend="dscompile", options={"lower": "inductor"}),
        "torch.compile inductor": lambda m: torch.compile(m, backend="inductor"),
    }
    times: dict[str, float] = {}
    reference = None
    for name, wrap in variants.items():
        torch._dynamo.reset()
        model = copy.deepcopy(case.model)
        step_fn = wrap(model)

        def step(step_fn: Any = step_fn, model: torch.nn.Module = model) -> torch.Tensor:
            loss = step_fn(*batch)
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss

        start = time.perf_counter()
        loss = float(step())
        first = time.perf_counter() - start
        ms, peak = timed(step, device, sizes.repeats, warmup=1)
        times[name] = ms
        reference = loss if reference is None else reference
        table.add("lowering", name, f"{ms:.2f} ms/step", f"first call {first:.1f} s; |loss - eager| {abs(loss - reference):.1e}; {_mem(peak)}")
    table.add("lowering", "triton / inductor (dscompile)", f"{times['dscompile lower=triton'] / times['dscompile lower=inductor']:.2f}x", "lower is better")


def _attention_impls(seq: int, sizes: Sizes, device: torch.device, kernel: str) -> tuple[dict[str, Callable[[], Any]], float]:
    """Forward + backward closures of each implementation at ``seq`` tokens, and the layout's density."""
    import torch.nn.functional as F

    from dscompile.kernels.sparse_attention_op import _compiled_flex, block_sparse_attention, flex_block_mask
    from dscompile.sparsity import BigBirdSparsityConfig

    heads, dim, block = sizes.heads, sizes.head_dim, sizes.block
    config = BigBirdSparsityConfig(heads, block, num_random_blocks=1, num_sliding_window_blocks=3, num_global_blocks=1)
    layout = config.make_layout(seq).to(device)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(1, heads, seq, dim, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(1, heads, seq, dim, generator=gen).to(device, dtype)
    scale = dim**-0.5

    def train(forward: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        return lambda: torch.autograd.grad(forward(), (q, k, v), grad)

    def op(which: str) -> Callable[[], torch.Tensor]:
        return lambda: block_sparse_attention(q, k, v, layout, None, None, block, scale, False, 0.0, which)[0]

    impls = {f"block-sparse ({kernel})": train(op(kernel)), "dense SDPA": train(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale))}
    if device.type == "cuda":
        mask = flex_block_mask(layout, block, seq, causal=False, kv_len=seq)
        flex = _compiled_flex()
        impls["FlexAttention"] = train(lambda: flex(q, k, v, block_mask=mask, scale=scale))
    else:  # FlexAttention has no CPU backward: the op's flex kernel (flex forward, reference backward)
        impls["FlexAttention fwd + ref bwd"] = train(op("flex"))
    return impls, float(layout.float().mean())


def run_sparse_attention(table: Table, sizes: Sizes, device: torch.device, deadline: float) -> None:
    from dscompile.kernels.sparse_attention_op import resolve_kernel

    kernel = resolve_kernel("auto", device)
    ours = f"block-sparse ({kernel})"
    for seq in sizes.seqs:
        if time.perf_counter() > deadline:
            table.add("sparse attention", f"seq {seq}", "skipped", "time budget spent")
            continue
        impls, density = _attention_impls(seq, sizes, device, kernel)
        results = {}
        for name, fn in impls.items():
            try:
                ms, peak = timed(fn, device, sizes.repeats)
            except torch.OutOfMemoryError:
                table.add("sparse attention", f"seq {seq} {name}", "out of memory", "")
                continue
            results[name] = ms
            table.add("sparse attention", f"seq {seq} {name}", f"{ms:.2f} ms fwd+bwd", _mem(peak))
        for other in [name for name in results if name != ours]:
            if ours in results:
                table.add("sparse attention", f"seq {seq} {other} / ours", f"{results[other] / results[ours]:.2f}x", f"layout density {density:.2f}")


def run_zero3_bf16(table: Table, sizes: Sizes, device: torch.device) -> None:
    import torch.distributed as dist

    import dscompile
    from dscompile.zoo import build, make_batch

    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        torch._dynamo.reset()
        case = build("gpt", seed=0, batch_size=sizes.batch, **sizes.gpt).to(device)
        config = {
            "train_micro_batch_size_per_gpu": sizes.batch,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "bf16": {"enabled": True},
        }
        engine, *_ = dscompile.initialize(model=case.model, config=config)
        batch = make_batch(case, seed=1)
        losses = []

        def step() -> None:
            loss = engine(*batch)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))

        start = time.perf_counter()
        step()
        first = time.perf_counter() - start
        ms, peak = timed(step, device, sizes.repeats, warmup=1)
        finite = all(v == v and abs(v) != float("inf") for v in losses)
        table.add("zero3 bf16", f"1 rank, {backend}", f"{ms:.2f} ms/step", f"first step {first:.1f} s; losses finite: {finite}; {_mem(peak)}")
    finally:
        dist.destroy_process_group()


def _decode_inputs(sizes: Sizes, device: torch.device, dtype: torch.dtype, queries: int, filled: int) -> tuple[torch.Tensor, ...]:
    """q, a cache of ``slots`` slots whose first ``filled`` are valid (NaN after: unread by the bounded kernels), a causal mask."""
    d = sizes.decode
    gen = torch.Generator().manual_seed(filled)
    q = torch.randn(d["batch"], d["heads"], queries, d["dim"], generator=gen).to(device, dtype)
    k, v = (torch.randn(d["batch"], d["kv_heads"], d["slots"], d["dim"], generator=gen).to(device, dtype) for _ in range(2))
    cols = torch.arange(d["slots"], device=device)
    rows = filled - queries + torch.arange(queries, device=device)
    mask = (cols[None, :] <= rows[:, None]).expand(d["batch"], 1, queries, d["slots"]).contiguous()
    return q, k, v, mask


def run_inference_kernels(table: Table, sizes: Sizes, device: torch.device) -> None:
    import torch.nn.functional as F

    from dscompile.kernels.cache_attention import cache_attention_torch, cache_attention_triton
    from dscompile.kernels.rotary import rotary_embedding, rotary_embedding_triton

    d = sizes.decode
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rep = d["heads"] // d["kv_heads"]
    cases = [("decode", 1, d["slots"] // 4), ("decode", 1, d["slots"] - 3), ("prefill", d["prefill"], d["prefill"])]
    for kind, queries, filled in cases:
        q, k, v, mask = _decode_inputs(sizes, device, dtype, queries, filled)
        valid = (slice(None), slice(None), slice(0, filled))
        sdpa_k, sdpa_v = k[valid].repeat_interleave(rep, 1), v[valid].repeat_interleave(rep, 1)
        expected = F.scaled_dot_product_attention(q.float(), sdpa_k.float(), sdpa_v.float(), attn_mask=mask[..., :filled])
        k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")
        full_k, full_v = torch.nan_to_num(k).repeat_interleave(rep, 1), torch.nan_to_num(v).repeat_interleave(rep, 1)
        impls = {
            "triton": lambda q=q, k=k, v=v, mask=mask: cache_attention_triton(q, k, v, mask),
            "torch path": lambda q=q, k=k, v=v, mask=mask: cache_attention_torch(q, k, v, mask),
            "SDPA, whole repeated cache": lambda q=q, fk=full_k, fv=full_v, mask=mask: F.scaled_dot_product_attention(q, fk, fv, attn_mask=mask),
        }
        times = {}
        for name, fn in impls.items():
            err = (fn().float() - expected).abs().max().item()
            times[name], _ = timed(fn, device, sizes.repeats)
            ok = err <= (2e-2 if dtype != torch.float32 else 1e-4)
            table.add("inference kernels", f"attn {kind} q={queries} len={filled}/{d['slots']} {name}", f"{times[name]:.3f} ms",
                      f"max |diff| vs fp32 SDPA {err:.1e}" + ("" if ok else "; FAILED"))
        ratio = times["torch path"] / times["triton"]
        table.add("inference kernels", f"attn {kind} len={filled} torch path / triton", f"{ratio:.2f}x", "higher: triton faster")

    gen = torch.Generator().manual_seed(0)
    for dt in dict.fromkeys((torch.float32, dtype)):
        for name, lead, rotary_dim in (("decode", (d["batch"], d["heads"], 1), None), ("prefill", (1, d["heads"], d["prefill"]), d["dim"] // 2)):
            x = torch.randn(*lead, d["dim"], generator=gen).to(device, dt)
            rd = rotary_dim or d["dim"]
            angles = torch.randn(lead[0], 1, lead[2], rd // 2, generator=gen).repeat(1, 1, 1, 2)
            cos, sin = angles.cos().to(device, dt), angles.sin().to(device, dt)
            equal = torch.equal(rotary_embedding_triton(x, cos, sin, rotary_dim), rotary_embedding(x, cos, sin, rotary_dim))
            t_triton, _ = timed(lambda x=x, cos=cos, sin=sin, rd=rotary_dim: rotary_embedding_triton(x, cos, sin, rd), device, sizes.repeats)
            t_torch, _ = timed(lambda x=x, cos=cos, sin=sin, rd=rotary_dim: rotary_embedding(x, cos, sin, rd), device, sizes.repeats)
            table.add("inference kernels", f"rotary {name} {tuple(x.shape)} {str(dt)[6:]} rd={rd}", f"{t_triton:.3f} ms",
                      f"torch {t_torch:.3f} ms; bit-equal: {equal}" + ("" if equal else "; FAILED"))
    if device.type != "cuda":
        table.add("inference kernels", "decode step in a CUDA graph", "skipped", "no CUDA")
        return
    _cuda_graph_decode(table, sizes, device, dtype)


def _cuda_graph_decode(table: Table, sizes: Sizes, device: torch.device, dtype: torch.dtype) -> None:
    """A decode step (write k/v at a device-side position, rotary, the cache-attention op) captured once, replayed per token."""
    from dscompile.runtime.inference.ops import CACHE_ATTENTION, ROTARY_EMBEDDING

    d = sizes.decode
    start = d["slots"] // 4
    q, k_cache, v_cache, mask = _decode_inputs(sizes, device, dtype, 1, start)
    gen = torch.Generator().manual_seed(1)
    new_k = torch.randn(d["batch"], d["kv_heads"], 1, d["dim"], generator=gen).to(device, dtype)
    new_v = torch.randn_like(new_k)
    angles = torch.randn(d["batch"], 1, 1, d["dim"] // 2, generator=gen).repeat(1, 1, 1, 2).to(device)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    pos = torch.tensor([start], device=device)

    def step() -> torch.Tensor:
        k_rot = ROTARY_EMBEDDING(new_k, cos, sin, None)
        k_cache.index_copy_(2, pos, k_rot)
        v_cache.index_copy_(2, pos, new_v)
        mask.index_fill_(3, pos, True)
        return CACHE_ATTENTION(ROTARY_EMBEDDING(q, cos, sin, None), k_cache, v_cache, mask, None)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile the kernels before capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = step()
    except Exception as exc:  # the contract: no host sync inside the op
        table.add("inference kernels", "decode step in a CUDA graph", "capture FAILED", f"{type(exc).__name__}: {str(exc)[:120]}")
        return
    worst = 0.0
    steps = 8
    for i in range(steps):
        pos.fill_(start + 1 + i)
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        eager = step()  # the same position again, eagerly
        worst = max(worst, (got.float() - eager.float()).abs().max().item())
    ok = worst <= 1e-3
    replay_ms, _ = timed(graph.replay, device, sizes.repeats)
    eager_ms, _ = timed(step, device, sizes.repeats)
    table.add("inference kernels", "decode step in a CUDA graph", f"{replay_ms:.3f} ms replay",
              f"eager {eager_ms:.3f} ms; {steps} replays vs eager max |diff| {worst:.1e}" + ("" if ok else "; FAILED"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on a CPU: checks that the script runs end to end")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for everything (the check must fit 8 minutes)")
    parser.add_argument("--skip-tests", action="store_true", help="leave out pytest -m gpu")
    parser.add_argument("--only", default="", help="comma-separated sections to run (tests, lowering, sparse attention, inference kernels, zero3 bf16)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_dry_run:
        print("no CUDA device: run on a GPU, or pass --cpu-dry-run to check the script on a CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda and not args.cpu_dry_run else torch.device("cpu")
    sizes = DRY_SIZES if args.cpu_dry_run else GPU_SIZES
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what training on a GPU uses; the tests switch it off themselves
    begin = time.perf_counter()
    deadline = begin + args.budget
    table = Table()
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run: numbers say nothing about a GPU)"
    table.add("machine", name, f"torch {torch.__version__}", f"triton {triton.__version__}")
    sections: list[tuple[str, Callable[[], None]]] = []
    if not args.skip_tests:
        sections.append(("tests", lambda: run_gpu_tests(table, timeout=deadline - time.perf_counter())))
    sections += [
        ("lowering", lambda: run_lowering(table, sizes, device)),
        ("sparse attention", lambda: run_sparse_attention(table, sizes, device, deadline)),
        ("inference kernels", lambda: run_inference_kernels(table, sizes, device)),
        ("zero3 bf16", lambda: run_zero3_bf16(table, sizes, device)),
    ]
    if args.only:
        sections = [(name, run) for name, run in sections if name in args.only.split(",")]
    failed = False
    for section, run in sections:
        if time.perf_counter() > deadline:
            table.add(section, "", "skipped", "time budget spent")
            continue
        try:
            run()
        except Exception as exc:  # one broken section must not hide the others' numbers
            failed = True
            table.add(section, "", "ERROR", f"{type(exc).__name__}: {str(exc)[:160]}")
    total = time.perf_counter() - begin
    table.add("total", "", f"{total:.0f} s", f"budget {args.budget:.0f} s")
    print("\n" + table.render())
    failed = failed or any("FAILED" in row[3] for row in table.rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
