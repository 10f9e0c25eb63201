"""Compile time and steady training-step time: dscompile's default pipeline against its peers.

Peers, all in this one process: eager PyTorch, torch.compile with Inductor (its defaults),
torch.compile with the aot_eager backend, dscompile with its default pipeline (which lowers to
Inductor on CPU) and dscompile with the eager lowering. Prints a table with ratios to Inductor.

    python bench/compile.py [--models gpt,llama,bert,mlp,cnn] [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from dscompile.zoo import build, make_batch

PEERS = {
    "eager": None,
    "inductor": {"backend": "inductor"},
    "aot_eager": {"backend": "aot_eager"},
    "dscompile": {"backend": "dscompile"},
    "dscompile(eager)": {"backend": "dscompile", "options": {"lower": "eager"}},
}


def train_step(model, optimizer, batch):
    loss = model(*batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def measure(name: str, peer: str, steps: int) -> dict[str, float]:
    torch._dynamo.reset()
    case = build(name)
    model = copy.deepcopy(case.model)
    runner = model if PEERS[peer] is None else torch.compile(model, **PEERS[peer])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [make_batch(case, seed=i) for i in range(steps + 1)]
    start = time.perf_counter()
    first_loss = train_step(runner, optimizer, batches[0])
    first = time.perf_counter() - start
    times = []
    for batch in batches[1:]:
        start = time.perf_counter()
        train_step(runner, optimizer, batch)
        times.append(time.perf_counter() - start)
    return {"first_step_s": first, "step_ms": 1e3 * statistics.median(times), "loss0": first_loss}


def main() -> None:
    # Cold compiles for every peer: Inductor's caches would otherwise let a later peer reuse an
    # earlier peer's kernels for the same graph.
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    inductor_config.autotune_local_cache = False
    torch._functorch.config.enable_autograd_cache = False
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama,bert,mlp,cnn")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.steps} steps after the first")
    header = f"{'model':8} {'peer':18} {'compile+1st s':>13} {'step ms':>9} {'step / inductor':>15} {'compile / inductor':>18} {'loss0':>9}"
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        rows = {peer: measure(name, peer, args.steps) for peer in PEERS}
        base = rows["inductor"]
        for peer, r in rows.items():
            print(
                f"{name:8} {peer:18} {r['first_step_s']:>13.2f} {r['step_ms']:>9.2f} "
                f"{r['step_ms'] / base['step_ms']:>15.2f} {r['first_step_s'] / base['first_step_s']:>18.2f} {r['loss0']:>9.4f}"
            )


if __name__ == "__main__":
    main()
