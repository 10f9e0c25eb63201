"""What every section of the GPU check shares: its context, the table of rows and ratios, alternated timing, fits.

A ratio is measured side by side: the peers run in alternation (A B A B ...), each round timing every peer
over a few steps, and the ratio is the median of the per-round ratios with their range. Rows and ratios are
written to the output files as they come, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Sizes:
    """Problem sizes of a real run (``GPU``) and of the CPU dry run (``DRY``)."""

    gpt: dict[str, int]
    llama: dict[str, int]
    batch: int
    attention: dict[str, int]
    seqs: list[int]
    density_windows: list[int]
    longest: dict[str, int]
    decode: dict[str, int]
    kernels: dict[str, int]
    rounds: int
    steps: int


GPU = Sizes(
    gpt={"seq_len": 512, "d_model": 512, "n_heads": 8, "n_layers": 4, "vocab_size": 8192},
    # ~106M parameters: 2 x 32.8M embedding/head + 4 x 10.5M layers (intermediate 2 x hidden, the zoo's choice)
    llama={"seq_len": 512, "hidden": 1024, "n_heads": 16, "n_layers": 4, "vocab_size": 32000},
    batch=8,
    attention={"heads": 8, "head_dim": 64, "block": 64},
    seqs=[4096, 8192, 16384],
    density_windows=[1, 3, 7, 15, 31, 63],
    # lengths of one attention layer's fwd+bwd searched by doubling, then bisection between the last that ran and the
    # first that did not; a probe slower than probe_s ends that search (a time cap, not a memory limit)
    longest={"start": 8192, "cap": 1 << 20, "probe_s": 20, "bisect": 2, "granule": 4096},
    decode={"prompt": 32, "new": 128, "hidden": 1024, "layers": 4, "heads": 16, "inter": 2816, "vocab": 32000},
    kernels={"batch": 4, "heads": 32, "kv_heads": 8, "dim": 128, "slots": 4096, "prefill": 1024},
    rounds=5,
    steps=10,
)
DRY = Sizes(
    gpt={"seq_len": 16, "d_model": 32, "n_heads": 2, "n_layers": 1, "vocab_size": 64},
    llama={"seq_len": 16, "hidden": 32, "n_heads": 2, "n_layers": 1, "vocab_size": 64},
    batch=2,
    attention={"heads": 1, "head_dim": 16, "block": 16},  # Triton runs in its interpreter: a few programs only
    seqs=[128],  # one length: FlexAttention compiles once per length, for many seconds on a CPU
    density_windows=[1, 3],
    longest={"start": 64, "cap": 128, "probe_s": 20, "bisect": 1, "granule": 16},
    decode={"prompt": 4, "new": 4, "hidden": 32, "layers": 1, "heads": 2, "inter": 64, "vocab": 64},
    kernels={"batch": 2, "heads": 4, "kv_heads": 2, "dim": 16, "slots": 40, "prefill": 8},
    rounds=2,
    steps=1,
)


@dataclass
class Ratio:
    """Median of per-round ratios and their range; ``target`` like ``"<= 1.0"``; ``meets`` None where no target."""

    median: float
    low: float
    high: float
    target: str = ""
    meets: bool | None = None
    bound: str = ""  # "" exact, ">=" a lower bound (a search stopped by a cap)

    def cell(self) -> str:
        spread = f" [{self.low:.2f}-{self.high:.2f}]" if self.high > self.low else ""
        return f"{self.bound}{self.median:.2f}x{spread}"


@dataclass
class Row:
    section: str
    case: str
    value: str
    note: str = ""
    ratio: Ratio | None = None


def meets(value: float, target: str) -> bool | None:
    if not target:
        return None
    op, _, bound = target.partition(" ")
    return {"<=": value <= float(bound), ">=": value >= float(bound)}[op]


@dataclass
class Table:
    """The check's rows, echoed as they come and rewritten to ``out`` (text) and ``out.json`` after each."""

    header: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    out: Path | None = None

    def add(self, section: str, case: str, value: str, note: str = "", ratio: Ratio | None = None) -> None:
        row = Row(section, case, value if ratio is None else ratio.cell(), note, ratio)
        self.rows.append(row)
        verdict = _verdict(row)
        print(f"  {section:12} {case:58} {row.value:>24}  {verdict}{note}", flush=True)
        self.save()

    def ratio(self, section: str, case: str, ratios: Sequence[float], target: str = "", note: str = "", bound: str = "") -> Ratio | None:
        """Add a ratio row from per-round ratios (nothing when there are none)."""
        ratios = [r for r in ratios if r == r and r not in (float("inf"), float("-inf"))]
        if not ratios:
            self.add(section, case, "n/a", note or "no paired rounds")
            return None
        middle = statistics.median(ratios)
        result = Ratio(middle, min(ratios), max(ratios), target, None if bound else meets(middle, target), bound)
        if bound and target.startswith(">=") and middle >= float(target.split()[1]):
            result.meets = True  # a lower bound already over a ">=" target
        self.add(section, case, "", note, result)
        return result

    def render(self) -> str:
        head = ("section", "case", "value", "target", "note")
        cells = [(r.section, r.case, r.value, _verdict(r).strip(), r.note) for r in self.rows]
        widths = [max(len(c[i]) for c in [head, *cells]) for i in range(4)]
        lines = [" | ".join(h.ljust(w) for h, w in zip(head, widths)) + " | note"]
        lines.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * 4)
        lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths)) + " | " + row[4] for row in cells]
        preamble = [f"{k}: {v}" for k, v in self.header.items()]
        return "\n".join([*preamble, "", *lines]) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {**self.header, "rows": [asdict(r) for r in self.rows]}

    def save(self) -> None:
        if self.out is None:
            return
        self.out.write_text(self.render())
        self.out.with_suffix(".json").write_text(json.dumps(self.to_json(), indent=1, default=str))


def _verdict(row: Row) -> str:
    r = row.ratio
    if r is None or not r.target:
        return ""
    state = {True: "meets", False: "MISSES", None: "open"}[r.meets]
    return f"({r.target}: {state}) "


@dataclass
class Ctx:
    """One run: the device, the sizes, the table, where traces go, and how the dry run stands in for compilers."""

    device: torch.device
    sizes: Sizes
    table: Table
    trace_dir: Path
    dry: bool
    deadline: float = float("inf")
    deepspeed: bool = True  # run the DeepSpeed peers where DeepSpeed imports (the dry run leaves them out by default)
    with_triton: bool = False  # the lowering section also times ``lower: triton`` (one compile more)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32

    @property
    def inductor(self) -> str:
        """Plain ``torch.compile``'s backend; the dry run uses ``aot_eager`` (Inductor's CPU compiles would take minutes)."""
        return "aot_eager" if self.dry else "inductor"

    def dscompile_options(self, **extra: Any) -> dict[str, Any]:
        """dscompile's options: the default lowering, or ``eager`` in the dry run (same reason)."""
        return ({"lower": "eager"} if self.dry else {}) | extra

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def deepspeed_missing(ctx: Ctx) -> str | None:
    """Why the DeepSpeed peers cannot run here (None: they can)."""
    if not ctx.deepspeed:
        return "dry run: --dry-deepspeed includes DeepSpeed (on a CPU it JIT-builds its comm op first)"
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # not installed, or its accelerator does not load here
        return f"{type(exc).__name__}: {str(exc)[:100]} (carry its wheel: docs/benchmarks.md)"
    return None


def millions(count: int) -> str:
    """``106M`` / ``25k``: a parameter count for a label."""
    return f"{count / 1e6:.0f}M" if count >= 1e6 else f"{count / 1e3:.0f}k"


def steady_ms(fn: Callable[[], Any], ctx: Ctx, steps: int) -> float:
    """Mean ms of ``steps`` back-to-back calls (synchronised at both ends)."""
    ctx.sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    ctx.sync()
    return (time.perf_counter() - start) * 1000 / steps


def alternate(peers: dict[str, Callable[[], Any]], ctx: Ctx, rounds: int | None = None, steps: int | None = None) -> dict[str, list[float]]:
    """ms per call of each peer, one value per round; the peers alternate within each round (A B C A B C ...).
    Stops after the first round once the section's deadline has passed."""
    rounds, steps = rounds or ctx.sizes.rounds, steps or ctx.sizes.steps
    times: dict[str, list[float]] = {name: [] for name in peers}
    for index in range(rounds):
        for name, fn in peers.items():
            times[name].append(steady_ms(fn, ctx, steps))
        if index >= 1 and ctx.left() < 0:
            break
    return times


def per_round(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(numerator, denominator) if b]


def timed_once(fn: Callable[[], Any], ctx: Ctx) -> tuple[Any, float]:
    """(result, seconds) of one call, synchronised: the first call of a compiled peer (its compile time)."""
    ctx.sync()
    start = time.perf_counter()
    result = fn()
    ctx.sync()
    return result, time.perf_counter() - start


def peak_step_mib(fn: Callable[[], Any], ctx: Ctx) -> tuple[float, float] | None:
    """(allocated MiB before the call, peak MiB during it) on CUDA; None on a CPU."""
    if not ctx.cuda:
        return None
    ctx.sync()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    before = torch.cuda.memory_allocated(ctx.device)
    fn()
    ctx.sync()
    return before / 2**20, torch.cuda.max_memory_allocated(ctx.device) / 2**20


def free_memory(ctx: Ctx) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``y = intercept + slope * x``: (slope, intercept, r²)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    return slope, intercept, (1 - ss_res / ss_tot) if ss_tot else 1.0


def overlap_fraction(comm: Sequence[tuple[float, float]], compute: Sequence[tuple[float, float]]) -> float | None:
    """Share of the communication intervals' time that some compute interval covers (None without communication)."""
    merged: list[list[float]] = []
    for start, end in sorted(compute):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = covered = 0.0
    for start, end in comm:
        total += end - start
        for c_start, c_end in merged:
            covered += max(0.0, min(end, c_end) - max(start, c_start))
    return covered / total if total else None
