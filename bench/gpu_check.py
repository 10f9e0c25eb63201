"""The GPU check: issue 35's four goals measured side by side on one GPU, one table of ratios.

    python bench/gpu_check.py --out OUT/gpu_check.txt    # one CUDA GPU; <= 8 minutes (--budget 400 s + 30 s grace)
    python bench/gpu_check.py --cpu-dry-run              # tiny sizes on a CPU: proves every section runs

Sections (``bench/gpucheck/``), in this order, each with a share of the budget (time a section leaves unused
goes to the next; past its share a section finishes the item in hand and skips the rest, saying so):

- ``lowering`` (goal 1): the default lowering / plain ``torch.compile``, zoo GPT and HF Llama, training step and
  ``no_grad`` forward, target <= 1.0;
- ``sparse`` (goal 2): block-sparse attention against dense SDPA (target >= 6 at 16k) and FlexAttention
  (>= 1), where a call's time goes, time against nonzero blocks (slope, intercept, r²), the longest sequence
  that trains against dense (math backend; target >= 10);
- ``zero3`` (goal 3): ZeRO-3 bf16 against FSDP2 (<= 1.0) and DeepSpeed (<= 0.7), step time and peak memory, and a
  profiler trace of one step (written to ``--trace-dir``);
- ``decode`` (goal 4): batch-1 decode tokens/s against HF eager (>= 2), ``torch.compile`` + static cache (>= 1)
  and DeepSpeed kernel injection (>= 1);
- ``kernels``: the inference Triton kernels against their torch paths, and ``tests``: ``pytest -m gpu``; these
  two run only with the time left.

Every ratio is the median of per-round ratios (peers alternated A B A B ...) with its range. The table goes to
stdout and, with ``--out FILE``, to FILE and ``FILE`` with the suffix ``.json`` (rewritten after every row, so a
run cut short leaves what it measured). A failing section prints ERROR and the next one runs; past the budget
plus ``--grace`` a watchdog writes the files and ends the process. In the dry run Inductor is replaced by
``aot_eager`` and dscompile lowers ``eager`` (Inductor's CPU compiles would take minutes); its numbers say
nothing about a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from gpucheck import decode, gpu_tests, inference_kernels, lowering, sparse, zero3  # noqa: E402  (bench/gpucheck/)
from gpucheck.common import DRY, GPU, Ctx, Table  # noqa: E402

SECTIONS: list[tuple[str, Callable[[Ctx], None], float]] = [
    ("lowering", lowering.run, 0.27),
    ("sparse", sparse.run, 0.22),
    ("zero3", zero3.run, 0.23),
    ("decode", decode.run, 0.28),
    ("kernels", inference_kernels.run, 0.0),  # share 0: only the time the goals left
    ("tests", gpu_tests.run, 0.0),
]


def _header(device: torch.device, args: argparse.Namespace) -> dict[str, str]:
    import triton

    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "CPU (dry run: the numbers say nothing about a GPU)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda) if cuda else "-",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "budget_s": f"{args.budget:.0f}",
        "command": " ".join(sys.argv),
    }


def _watchdog(table: Table, seconds: float) -> threading.Timer:
    """Past the budget and its grace: write what was measured and end the process (a compile may hang)."""

    def fire() -> None:
        table.add("watchdog", "", "stopped", f"the run passed {seconds:.0f} s; the rows above are what it measured")
        print("\n" + table.render(), flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on a CPU: checks that every section runs")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds for all sections (the check must fit 8 minutes)")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds past the budget before the watchdog ends the run")
    parser.add_argument("--only", default="", help=f"comma-separated sections: {', '.join(name for name, _, _ in SECTIONS)}")
    parser.add_argument("--skip-tests", action="store_true", help="leave out pytest -m gpu")
    parser.add_argument("--with-triton", action="store_true", help="lowering: also time dscompile's Triton codegen (lower: triton) on the GPT step")
    parser.add_argument("--dry-deepspeed", action="store_true",
                        help="dry run: include the DeepSpeed peers (on a CPU DeepSpeed JIT-builds its shared-memory comm op first: minutes)")
    parser.add_argument("--out", type=Path, help="write the table to this file and the rows as JSON beside it (.json)")
    parser.add_argument("--trace-dir", type=Path, help="where the profiler trace goes (default: --out's folder, else a temporary folder)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu_dry_run
    if not cuda and not args.cpu_dry_run:
        print("no CUDA device: run on a GPU, or pass --cpu-dry-run to check the script on a CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # what training on a GPU uses (the lowering section's fp32 models)
    torch._dynamo.config.cache_size_limit = 64  # several peers compile the same forward
    chosen = [s for s in SECTIONS if not args.only or s[0] in args.only.split(",")]
    if args.skip_tests:
        chosen = [s for s in chosen if s[0] != "tests"]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    trace_dir = args.trace_dir or (args.out.parent if args.out else Path(tempfile.mkdtemp(prefix="gpu_check_")))
    trace_dir.mkdir(parents=True, exist_ok=True)
    table = Table(header=_header(device, args), out=args.out)
    for key, value in table.header.items():
        print(f"{key}: {value}", flush=True)
    begin = time.perf_counter()
    end = begin + args.budget
    timer = _watchdog(table, args.budget + args.grace)
    failed = False
    for index, (name, run, share) in enumerate(chosen):
        left = end - time.perf_counter()
        shares = sum(s for _, _, s in chosen[index:])
        deadline = time.perf_counter() + (left * share / shares if share and shares else left)
        if left <= 0 or (not share and left < 20):
            table.add(name, "", "skipped", f"{max(left, 0):.0f} s of the budget left")
            continue
        ctx = Ctx(device, DRY if args.cpu_dry_run else GPU, table, trace_dir, args.cpu_dry_run, deadline,
                  deepspeed=not args.cpu_dry_run or args.dry_deepspeed, with_triton=args.with_triton or args.cpu_dry_run)
        started = time.perf_counter()
        torch._dynamo.reset()
        try:
            run(ctx)
        except Exception as exc:  # one broken section must not hide the others' numbers
            failed = True
            table.add(name, "", "ERROR", f"{type(exc).__name__}: {str(exc)[:200]}")
            import traceback

            traceback.print_exc()
        table.add(name, "section time", f"{time.perf_counter() - started:.0f} s", f"share ended {max(0.0, deadline - started):.0f} s after its start")
    timer.cancel()
    table.add("total", "", f"{time.perf_counter() - begin:.0f} s", f"budget {args.budget:.0f} s")
    print("\n" + table.render())
    failed = failed or any(r.value in ("ERROR", "capture FAILED") or "FAILED" in r.note for r in table.rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
