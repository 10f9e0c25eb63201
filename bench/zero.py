"""ZeRO-1/2/3 step time and per-rank peak memory: dscompile against DeepSpeed and FSDP2.

World size 2 on gloo (CPU), a GPT-style model (default ~55M parameters), the same data and
AdamW for every peer. Each peer runs in its own spawn of ranks (so memory is its own):

- ``dscompile-z1/2/3``: ``dscompile.initialize`` with ``zero_optimization.stage`` 1/2/3.
- ``dscompile-z3-profiled``: ZeRO-3 with ``profile_steps`` (``--profile-steps``, in the warm-up): the
  plan is measured, agreed across ranks and recompiled once before the steady steps.
- ``deepspeed-z1/2/3``: DeepSpeed 0.19.8's engine (``pip install deepspeed``), gloo, torch AdamW.
- ``fsdp2``, ``fsdp2-compiled``: ``fully_shard`` per block and the root, eager and torch.compile.

Step time is the median of the steady steps (after warm-up, which includes compilation); peak
memory is the highest resident set size sampled every millisecond during the steady steps,
minus the resident size before the model was built. Prints one table with ratios to
DeepSpeed ZeRO-3 and to FSDP2, and each peer's losses (they must agree).

    python bench/zero.py [--d-model 768 --layers 6 --vocab 16384 --seq 128 --batch 2] [--steps 4]
    python bench/zero.py --peers dscompile-z3,dscompile-z3-profiled --profile-steps 1 --warmup 3
    python bench/zero.py --model hf_gpt2 --d-model 512 --heads 8 --layers 6 --rounds 3   # HF GPT-2 from a config, A B A B
    python bench/zero.py --peers dscompile-z3,fsdp2 --profile    # one extra step per peer under torch.profiler

``--rounds R`` runs the peers alternated (A B C A B C ...) R times and reports the median of the
runs' medians with the spread (max-min)/median; each rank runs with ``torch.set_num_threads(1)``
(printed per rank), so two ranks share this 2-core machine without oversubscribing it.

Where a ZeRO-3 step's time went (``--profile``, 55M GPT, rank 0, self CPU time of one profiled step;
the machine was shared, load average 17-29 on 2 cores, so only the proportions mean much)
-------------------------------------------------------------------------------------------------
Before (commit b465030), 39.2 s profiled step:

- 10.9 s (28%) in 5 ``wait_tensor`` calls: the whole forward's gathers were one bucket (the 50M
  ``stage3_prefetch_bucket_size`` covers the model), the backward re-gather another, and every
  gradient one reduce-scatter bucket (500M ``reduce_bucket_size``) issued after the last gradient:
  nothing overlapped, every byte was waited for.
- 8.1 s (21%) in 519 ``aten::copy_``: the shards concatenated into each bucket and every parameter
  copied out of its ``[N, L]`` columns (and the gradients into theirs): three extra passes over the
  model's bytes per step, on a CPU where a copy of a few MiB costs more than a gloo collective's latency.
- ~1.3 s (3%) in AdamW's single-tensor loop (``addcdiv_``, ``sqrt``, ``lerp_``, ... x76 shards): torch
  picks neither foreach nor fused on CPU by default, so about ten passes over the states.
- 14.4 s in ``mm``/``addmm`` and 8.2 s in Inductor's fused kernels: the model itself.

FSDP2 eager on the same run: 19.2 s profiled step, 3.4 s in its per-block all-gathers (waiting
included), 2.5 s in copies (its ``split_with_sizes_copy``/``chunk_cat`` of per-block flat buffers), 8.3 s in ``mm``/``addmm``.

After (this branch), 23.1 s profiled step (same model, losses unchanged to the last printed digit):

- collectives on CPU move alone unless they are small (``passes/zero_bucketing.py``: at most 64Ki
  elements share a bucket): the big parameters are gathered and their gradients reduce-scattered
  without any copy, each where the prefetch/overlap passes place it, so they overlap compute:
  3.8 s in 102 ``wait_tensor`` (was 10.9 s), 2.2 s in ``copy_`` (was 8.1 s);
- the shards are stepped by torch's fused AdamW (``runtime/zero_extension.py``, when the user left
  the implementation open): 0.27 s (was ~1.3 s);
- peak memory 1304 MiB (was 1557): no whole-model flat bucket.

What remains: ``mm``/``addmm`` took 14.9 s in that profile against FSDP2's 8.3 s for the same shapes
(not explained yet: the load differed between the runs; to check on a quiet machine), and 2.2 s of
copies (409 ``copy_``, not yet attributed: gradient accumulation into the shard grads, AOTAutograd's
clones). See the table at the end of a run for the step times against the peers.

Step times measured on this branch (machine shared with other jobs, load average 16-19 on 2 cores: noisy)
-------------------------------------------------------------------------------------------------------
55M GPT, one run each (``--profile`` runs, 3 steady steps): dscompile ZeRO-3 16748 ms/step before, 14038
after (0.84x); FSDP2 eager 10582 in the "before" run (not re-run after: dscompile ZeRO-3 is still slower
than FSDP2 eager on it, by these figures ~1.3x). Peak 1557 -> 1304 MiB (FSDP2 1569).

HF GPT-2 from a config (hidden 512, 8 heads, 4 layers, vocab 8192, seq 128, batch 2/rank; peers alternated,
3 steady steps per run; the load fell from ~18 to ~10 between the rounds, so the two rounds differ 2-5x):

    peer            round 1   round 2   (ms/step; peak MiB)
    dscompile-z3      5979      1276    (657, 664)
    fsdp2 eager       7010      2516    (738, 753)
    deepspeed-z3      7352      3320    (898, 915)
    dscompile-z2      4619      1643    (810, 790)
    deepspeed-z2      4150      1180    (694, 709)
    dscompile-z1      2267      1393    (814, 793)
    deepspeed-z1      2648      1396    (721, 730)

ZeRO-3 against FSDP2 eager: 0.85x (round 1), 0.51x (round 2); against DeepSpeed ZeRO-3: 0.81x, 0.38x; at
lower peak memory than both. ZeRO-2 1.11x / 1.39x DeepSpeed's and ZeRO-1 0.86x / 1.00x (targets <= 0.7x:
not met; ZeRO-1/2's out-of-graph reduce and post-step refresh were not worked on here). Medians of the two
rounds: ZeRO-3 0.76x FSDP2 eager, 0.68x DeepSpeed ZeRO-3; losses equal across peers to 4 digits. The spread
between rounds (48-130%) is far above the 10% target because of the shared machine; a quiet machine and more
rounds are needed before any of these ratios is a claim.

Quiet machine (2026-12-04, load average under 3 while it ran), HF GPT-2 as above but vocab 16384 (21.1M
parameters), 4 steady steps per run, 3 rounds alternated, ratios the median of per-round ratios [min-max]:

    peer            ms/step  spread  vs DeepSpeed same stage  vs FSDP2 eager      peak MiB
    dscompile-z1       972     11%     0.71x [0.56-0.94]       0.85x [0.76-0.86]     852
    deepspeed-z1      1291     62%     -                       1.22x [0.81-1.52]     700
    dscompile-z2      1046     13%     0.92x [0.82-0.92]       0.90x [0.75-0.99]     828
    deepspeed-z2      1166      4%     -                       0.99x [0.91-1.07]     691
    dscompile-z3      1082      6%     0.85x [0.77-0.94]       0.87x [0.87-0.88]     646
    deepspeed-z3      1355     13%     -                       1.14x [0.93-1.28]     912
    fsdp2 (eager)     1205     18%     -                       1.00x                 751

dscompile is ahead of both peers at every stage, ZeRO-3 at the lowest peak memory, but no target is met:
ZeRO-3 0.87x FSDP2 eager (target 0.85x) and 0.85x DeepSpeed (0.7x); ZeRO-1 0.71x and ZeRO-2 0.92x
DeepSpeed (0.7x); dscompile's spread 6-13% (target under 10%). dscompile-z3's third-round run died once with glibc's
"malloc(): unaligned tcache chunk detected" (4 more rounds did not repeat it). DeepSpeed on CPU
communicates through its shared-memory op (deepspeed_shm_comm_op; 0.5 ms of collective time in a
profiled ZeRO-2 step against dscompile's 745 ms of gloo waits under load): gloo over loopback is where
dscompile loses most against it here. (Corrected on 2026-12-05: DeepSpeed 0.19.8 builds that op but uses it only
for inference's all-reduce; its ZeRO collectives go through torch.distributed on gloo like dscompile's. Its
collectives are synchronous, inside its hooks, so the profiler files their time under other rows.)

Where the time went on 2026-12-05 (quiet machine, ``--model hf_gpt2 --d-model 512 --heads 8 --layers 4 --profile``,
rank 0, one profiled step), and what changed:

- ZeRO-3, 769 ms/step: 274 ms (35%) in ``wait_tensor``, 342 ms in ``mm``/``addmm`` (FSDP2: 364 ms). Every parameter
  was gathered twice, in forward and again in backward. With two ranks and one compute thread each sharing two
  cores, gloo's transfers take CPU time from the compute, so overlap hides little: the bytes themselves cost.
  Fix: DeepSpeed's ``stage3_max_reuse_distance`` (``passes/zero.py``): a parameter used again in backward within
  that many elements stays gathered. With DeepSpeed's default 1e9 this keeps the whole 21M model, as DeepSpeed
  does. Result: 669 ms/step, 128 ms waiting, peak 639 against 626 MiB.
- ZeRO-2, 733 ms/step, and ZeRO-1, 831 ms/step: the out-of-graph collectives, ZeRO-1's gradient reduce-scatter
  and the post-step refresh of both, were one flat bucket of the whole model (capped at 64 MiB) and synchronous.
  The cost was three copies (pad/cat in, clone or column copy out) and no overlap: 125 ms of copies in ZeRO-1.
  Fix (``runtime/zero_shard.py``): the graphs' CPU rule, where a parameter over 64Ki elements moves alone. An
  unpadded one is reduce-scattered straight from its gradient and gathered straight into its full copy. All are
  asynchronous and finished in order, so each bucket's copy-out overlaps the later transfers. Peak memory fell
  too (no whole-model flat buffers).

Measured after both changes (2026-12-05, quiet machine, load under 1 before the run), HF GPT-2 (hidden 512,
8 heads, 4 layers, vocab 16384: 21.1M parameters), 4 steady steps per run, 3 rounds alternated; ratios are the
median of the per-round ratios [min-max]:

    peer            ms/step  spread  vs DeepSpeed same stage  vs FSDP2 eager      peak MiB
    dscompile-z1       649      6%     0.72x [0.70-0.73]       0.79x [0.77-0.82]     632
    deepspeed-z1       900      5%     -                       1.10x [1.09-1.14]     674
    dscompile-z2       676      6%     0.75x [0.74-0.78]       0.83x [0.81-0.86]     641
    deepspeed-z2       905      2%     -                       1.10x [1.10-1.11]     678
    dscompile-z3       664      3%     0.66x [0.66-0.68]       0.81x [0.80-0.81]     628
    deepspeed-z3       984      3%     -                       1.20x [1.20-1.23]     871
    fsdp2 (eager)      821      1%     -                       1.00x                 729

Losses are equal across the peers to 3-4 digits.

The default 55M GPT (d_model 768, 12 heads, 6 layers, vocab 16384), same conditions, 3 rounds alternated:

    peer            ms/step  spread  vs DeepSpeed same stage  vs FSDP2 eager      peak MiB
    dscompile-z3      1537      2%     0.62x [0.61-0.65]       0.75x [0.74-0.79]    1241
    fsdp2 (eager)     2052      4%     -                       1.00x                1454
    deepspeed-z3      2500      6%     -                       1.23x [1.15-1.27]    1815

ZeRO-3 meets the targets on both models: at most 0.85x FSDP2 eager and 0.7x DeepSpeed ZeRO-3, at lower peak
memory than both, with dscompile's spread 2-3%. ZeRO-1 (0.72x) and ZeRO-2 (0.75x) are ahead of DeepSpeed but
short of 0.7x.

55M GPT, ZeRO-1/2, 2 rounds alternated (same conditions): dscompile-z1 1478 ms/step, 0.69x [0.69-0.70] DeepSpeed
ZeRO-1's (2134 ms), peak 1342 against 1375 MiB; dscompile-z2 1525 ms, 0.72x [0.71-0.73] DeepSpeed ZeRO-2's (2119 ms),
peak 1239 against 1276 MiB.

Gloo's reduce-scatter is an all-reduce of a clone of the whole input, twice the bytes of a reduce-scatter: 8M fp32
elements on 2 ranks, 42.8 ms, against 43.4 ms for an all-reduce and 15.9 ms for an all-to-all plus a local sum
(median of 5). ZeRO-1's out-of-graph reduce-scatter now uses the all-to-all on gloo (``ZeroPartition._reduce_scatter_async``).
HF GPT-2, ZeRO-1 against DeepSpeed ZeRO-1, two runs of 2 alternated rounds: 653, 588, 644 and 652 ms/step against
910, 915, 905 and 933 ms; per-round ratios 0.72, 0.64, 0.71 and 0.70x.
A first swap inside the ZeRO-2/3 graphs (reverted in 34a86a3) had one rank die with SIGSEGV in one benchmark run;
the cause was not pinned down. Gloo reads an all-to-all's input on its own thread after the call returns.

2026-12-05, later: gloo's collectives, measured and chosen (``passes/zero.py::zero_gloo``, ``runtime/zero_shard.py``)
----------------------------------------------------------------------------------------------------------------
- Reduce-scatters in the ZeRO-2/3 graphs are one all-to-all each, waited and summed by ``dscompile::zero_sum_received``,
  which takes the all-to-all's input as an argument so the lowering keeps that buffer until gloo has sent it.
  No rank has died in any of the 20-odd benchmark runs since (ZeRO-2 and ZeRO-3, both models).
- Gloo's all-gather is two to three times slower than one broadcast per rank moving the same bytes (8M fp32
  elements: 32.5 against 15.3 ms on 2 ranks, 60.7 against 23.4 ms on 4; 256Ki: 0.97 against 0.45 ms; 64Ki: 0.29
  against 0.43 ms, so small ones stay all-gathers). Every all-gather over 256Ki elements on gloo now runs as one
  broadcast per rank: ZeRO-1/2's post-step refresh (outside the graphs) and ZeRO-3's gathers in the graphs
  (``dscompile::zero_broadcast_gather``, its broadcasts registered as one work for ``wait_tensor``).
- Where ZeRO-2's time went before the refresh change (HF GPT-2, rank 0, one profiled step of 613 ms): backward to
  ~508 ms, with its all-to-alls overlapping it except the tied embedding's (8.4M elements, final only at the end of
  backward: a 28 ms wait), the step ~20 ms, then the refresh's 35 all-gathers ~85 ms. ``mm``/``addmm``: 346 ms.
  ZeRO-1 (729 ms profiled): the reduce after backward ~125 ms, the refresh ~95 ms.

Measured on 2026-12-05 after both changes, quiet machine except where noted, world 2 gloo, peers alternated,
median of per-round ratios [min-max], losses equal across the peers to 3-4 digits:

    HF GPT-2 (21.1M), 3 rounds               ms/step  spread  vs DeepSpeed same stage  vs FSDP2 eager  peak MiB
    dscompile-z3                                688     4%     0.64x [0.64-0.66]       0.75x [0.74-0.78]    545
    fsdp2 (eager)                               917     0%     -                       1.00x                781
    deepspeed-z3                               1074     1%     -                       1.17x [1.16-1.18]    876
    dscompile-z1                                673     6%     0.70x [0.68-0.71]       -                    590
    deepspeed-z1                                942     9%     -                       -                    682
    dscompile-z2                                630     7%     0.65x [0.52-0.69]       -                    616
    deepspeed-z2                               1016    30%     -                       -                    676

    HF GPT-2, ZeRO-1/2 only, 2 rounds (after the refresh change, before ZeRO-3's in-graph broadcasts, which
    ZeRO-1/2 do not use): dscompile-z2 610 ms 0.66x [0.65-0.68], dscompile-z1 629 ms 0.67x [0.67-0.67];
    DeepSpeed 920 and 937 ms; spreads 0-3%.

    55M GPT, 3 rounds                        ms/step  spread  vs DeepSpeed same stage  vs FSDP2 eager  peak MiB
    dscompile-z3                               1543    28%     0.58x [0.55-0.62]       0.71x [0.70-0.75]    940
    fsdp2 (eager)                              2179    34%     -                       1.00x               1513
    deepspeed-z3                               2823    18%     -                       1.29x [1.13-1.30]   1795
    dscompile-z2                               1524     5%     0.67x [0.66-0.67]       -                   1167
    deepspeed-z2                               2262     4%     -                       -                   1310
    dscompile-z1                               1477    15%     0.69x [0.67-0.71]       -                   1152
    deepspeed-z1                               2135     9%     -                       -                   1310

The 55M ZeRO-3 rows' spreads come from a first round that ran slower for every peer (the host, not a peer:
1959/2799/3154 ms, then 1535-1543 for dscompile); rounds 2 and 3 agree within 1%. Two other full runs of all seven
peers on HF GPT-2 were spoiled by outside load (every peer 20-60% slower in some rounds, spreads 20-64%); their
medians were ZeRO-1 0.69x, ZeRO-2 0.63x and 0.68x, ZeRO-3 0.65x and 0.68x DeepSpeed's.
ZeRO-1 is the closest to its target: 0.67-0.70x in every run. What is left there: its reduce-scatter runs after
backward (outside the graphs), where ZeRO-2's overlaps backward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import alternate, median_spread, ratio_cell, resident_bytes, timed_steps  # noqa: E402  (bench/harness.py)

PEERS = ["dscompile-z1", "dscompile-z2", "dscompile-z3", "dscompile-z3-profiled", "deepspeed-z1", "deepspeed-z2", "deepspeed-z3", "fsdp2", "fsdp2-compiled"]
LR = 1e-4


def _case(args: dict[str, Any]) -> Any:
    from dscompile.zoo import build

    if args["model"] == "hf_gpt2":
        return build(
            "hf_gpt2", seed=0, batch_size=args["batch"], seq_len=args["seq"], hidden=args["d_model"], n_heads=args["heads"],
            n_layers=args["layers"], vocab_size=args["vocab"],
        )
    return build(
        "gpt", seed=0, batch_size=args["batch"], seq_len=args["seq"], d_model=args["d_model"], n_heads=args["heads"], n_layers=args["layers"],
        vocab_size=args["vocab"],
    )


def _blocks(model: Any) -> Any:
    """The transformer blocks FSDP2 shards one by one (the zoo GPT's, or HF GPT-2's ``transformer.h``)."""
    return model.blocks if hasattr(model, "blocks") else model.model.transformer.h


def _batches(case: Any, rank: int, count: int) -> list[tuple[torch.Tensor, ...]]:
    from dscompile.zoo import make_batch

    return [make_batch(case, seed=1000 * i + rank) for i in range(count)]


def _adamw_section() -> dict[str, Any]:
    return {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}}


def _build(peer: str, case: Any, args: dict[str, Any]) -> Any:
    """Return step(batch) -> loss for one peer."""
    model = case.model
    if peer.startswith("dscompile"):
        import dscompile

        stage = int(peer.split("-")[1][1:])
        profile_steps = args["profile_steps"] if peer.endswith("-profiled") else 0  # DeepCompile-style re-planning
        config = {
            "train_micro_batch_size_per_gpu": args["batch"],
            "optimizer": _adamw_section(),
            "zero_optimization": {"stage": stage, "overlap_comm": True, "stage3_param_persistence_threshold": 1e4, "profile_steps": profile_steps,
                                  **args["zero_extra"]},
            "lower": args["lower"],
        }
        engine, _, _, _ = dscompile.initialize(model=model, config=config)

        def step(batch: tuple) -> float:
            loss = engine(*batch)
            engine.backward(loss)
            engine.step()
            return loss.item()

        return step
    if peer.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        stage = int(peer[-1])
        config = {
            "train_micro_batch_size_per_gpu": args["batch"],
            "optimizer": _adamw_section(),
            "zero_optimization": {"stage": stage, "overlap_comm": False, "stage3_param_persistence_threshold": 1e4},
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step(batch: tuple) -> float:
            loss = engine(*batch)
            engine.backward(loss)
            engine.step()
            return loss.item()

        return step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    runner = torch.compile(model) if peer == "fsdp2-compiled" else model

    def step(batch: tuple) -> float:
        loss = runner(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def peer_rank(rank: int, world: int, peer: str, args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    import dscompile  # noqa: F401  (libraries loaded before the baseline: their code is not model memory)

    if peer.startswith("deepspeed"):
        import deepspeed  # noqa: F401
    baseline = resident_bytes()
    torch.manual_seed(0)
    case = _case(args)
    params = sum(p.numel() for p in case.model.parameters())
    batches = _batches(case, rank, args["warmup"] + args["steps"])
    step = _build(peer, case, args)
    losses, times, peak = timed_steps(step, batches, args["warmup"], barrier=dist.barrier)
    out = {"step_s": statistics.median(times), "peak_bytes": peak - baseline, "losses": losses, "params": params,
           "threads": torch.get_num_threads()}
    if args["profile"]:
        out["profile"] = profile_step(step, batches[-1])
    return out


COLLECTIVE_MARKERS = ("gloo:", "c10d::", "_c10d_functional::", "all_gather", "reduce_scatter", "allreduce", "all_reduce", "broadcast")
COPY_OPS = {"aten::copy_", "aten::cat", "aten::constant_pad_nd", "aten::clone", "aten::_to_copy", "aten::slice", "aten::view", "aten::narrow",
            "aten::as_strided", "aten::empty", "aten::new_empty", "aten::zeros", "aten::fill_", "aten::zero_", "aten::split", "aten::stack"}


def profile_step(step: Any, batch: tuple) -> dict[str, Any]:
    """One more step under the torch profiler: self CPU time by op, grouped into collectives, waits,
    copies and the rest, and the top ops (``--profile``)."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(batch)
    wall = time.perf_counter() - start
    rows = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()]
    groups = {"wait": 0.0, "collective": 0.0, "copy/layout": 0.0, "optimizer (foreach/fused)": 0.0, "compute/other": 0.0}
    for key, sec, _ in rows:
        if "wait" in key.lower():
            groups["wait"] += sec
        elif any(m in key for m in COLLECTIVE_MARKERS):
            groups["collective"] += sec
        elif key in COPY_OPS:
            groups["copy/layout"] += sec
        elif "foreach" in key or "fused_adam" in key or "Optimizer.step" in key:
            groups["optimizer (foreach/fused)"] += sec
        else:
            groups["compute/other"] += sec
    top = sorted(rows, key=lambda r: -r[1])[:25]
    return {"wall_s": wall, "groups": groups, "top": top}


def main() -> None:
    parser = argparse.ArgumentParser(description="ZeRO benchmark: dscompile vs DeepSpeed vs FSDP2 (world 2, gloo)")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring (compilation happens here)")
    parser.add_argument("--lower", default="inductor", choices=["eager", "inductor"], help="dscompile's lowering")
    parser.add_argument("--profile-steps", type=int, default=1, help="dscompile-z3-profiled: steps profiled before re-planning (in warm-up)")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--model", default="gpt", choices=["gpt", "hf_gpt2"], help="the zoo GPT or a Hugging Face GPT-2 built from a config")
    parser.add_argument("--rounds", type=int, default=1, help="peers alternated A B A B ...: each peer runs this many times; median and spread")
    parser.add_argument("--profile", action="store_true", help="profile one extra step per peer (rank 0's op table grouped)")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--zero-extra", type=json.loads, default={}, help="more dscompile zero_optimization keys, as JSON")
    opts = parser.parse_args()
    if opts.profile_steps < 1 or opts.warmup <= opts.profile_steps:
        parser.error("need 1 <= --profile-steps < --warmup: the profiled steps and the recompile after them are not steady steps")
    from dscompile.testing.distributed import DistributedRunError, run_distributed

    args = {"d_model": opts.d_model, "heads": opts.heads, "layers": opts.layers, "vocab": opts.vocab, "seq": opts.seq, "batch": opts.batch,
            "steps": opts.steps, "warmup": opts.warmup, "lower": opts.lower, "profile_steps": opts.profile_steps, "model": opts.model,
            "profile": opts.profile, "zero_extra": opts.zero_extra}
    def run_peer(peer: str, round_index: int) -> dict[str, Any] | None:
        torch._dynamo.reset()
        try:
            ranks = run_distributed(peer_rank, 2, peer, args, timeout=opts.timeout)
        except (DistributedRunError, ImportError) as exc:
            print(f"{peer}: failed: {str(exc).splitlines()[0]}", flush=True)
            return None
        run = {
            "step_s": max(r["step_s"] for r in ranks),
            "peak_bytes": max(r["peak_bytes"] for r in ranks),
            "losses": [sum(v) / len(ranks) for v in zip(*(r["losses"] for r in ranks), strict=True)],
            "params": ranks[0]["params"],
        }
        print(f"[round {round_index + 1}] {peer}: {run['step_s'] * 1e3:.0f} ms/step, peak {run['peak_bytes'] / 2**20:.0f} MiB, "
              f"threads per rank {[r['threads'] for r in ranks]}", flush=True)
        if opts.profile and round_index == 0:
            prof = ranks[0]["profile"]
            print(f"  profile (rank 0, one step {prof['wall_s'] * 1e3:.0f} ms wall under the profiler), self CPU seconds by group:")
            for group, sec in prof["groups"].items():
                print(f"    {group:28} {sec * 1e3:9.1f} ms")
            for key, sec, count in prof["top"][:15]:
                print(f"    {sec * 1e3:9.1f} ms  x{count:<5} {key}")
        return run

    results = alternate(opts.peers.split(","), opts.rounds, run_peer)
    if not results:
        return
    params = next(iter(results.values()))[0]["params"]
    print(
        f"\nGPT {params / 1e6:.1f}M params, world 2 gloo, batch {opts.batch}x{opts.seq}/rank, dscompile lowering {opts.lower}, "
        f"dscompile-z3-profiled re-plans after {opts.profile_steps} profiled step(s)"
    )
    print(f"{opts.rounds} round(s), peers alternated; step ms is the median over rounds of each run's median step, spread = (max-min)/median;"
          " ratios: median of the per-round ratios [min-max]")
    header = f"{'peer':22} {'step ms':>9} {'spread':>7} {'vs DS same stage':>22} {'vs FSDP2':>22} {'peak MiB':>9}  losses (last round)"
    print(header)
    print("-" * len(header))
    for peer, runs in results.items():
        stage = peer.split("-")[1][:2] if peer.startswith("dscompile") else ""
        step_s, spread = median_spread(r["step_s"] for r in runs)
        vs_ds = ratio_cell(runs, results.get(f"deepspeed-{stage}")) if stage else "-"
        vs_fsdp = ratio_cell(runs, results.get("fsdp2"))
        peak = max(r["peak_bytes"] for r in runs)
        losses = " ".join(f"{v:.4f}" for v in runs[-1]["losses"])
        print(f"{peer:22} {step_s * 1e3:9.0f} {spread:6.0%} {vs_ds:>22} {vs_fsdp:>22} {peak / 2**20:9.0f}  {losses}")

if __name__ == "__main__":
    main()
