"""Decode speed with and without kernel injection's rotary and KV-cache attention passes.

    python bench/inference_kernels.py [--max-out 1024] [--batch 1] [--new 64] [--repeats 5] [--threads N]

A 6-layer, hidden-512 Llama with grouped-query attention (8 query heads over 2 KV heads), random
weights, fp32, the default lowering (Inductor on CPU), a 16-token prompt. Three engines, all with
``replace_with_kernel_inject``: the fusion passes without the two new ones, with the rotary pass only,
and with both; they run in alternation after one warm-up each (which compiles). Prints decode tokens/s
(median, min, max), the ratios to the first, and whether all three generated the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    import transformers as tf

    import dscompile
    import dscompile.engines.inference as inference

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-out", type=int, default=1024, help="max_out_tokens: the static KV cache's slots")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = tf.LlamaConfig(
        num_hidden_layers=6, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1376, vocab_size=8000,
        max_position_embeddings=max(4096, args.max_out), bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 8000, (args.batch, 16), generator=torch.Generator().manual_seed(1))
    every = inference.FUSION_PASSES
    variants = {
        "without": tuple(p for p in every if p not in ("fuse_rotary_embedding", "fuse_cache_attention")),
        "rotary only": tuple(p for p in every if p != "fuse_cache_attention"),
        "both": every,
    }
    engines = {}
    try:
        for name, passes in variants.items():
            inference.FUSION_PASSES = passes  # read when the engine builds its pipeline
            engines[name] = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=args.max_out, replace_with_kernel_inject=True)
            start = time.perf_counter()
            engines[name].generate(ids, max_new_tokens=args.new)
            print(f"{name:12s} warm-up (compiles) {time.perf_counter() - start:.1f} s", flush=True)
    finally:
        inference.FUSION_PASSES = every
    rates: dict[str, list[float]] = {name: [] for name in engines}
    tokens = {}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            out = engine.generate(ids, max_new_tokens=args.new, return_dict_in_generate=True)
            rates[name].append((out.new_tokens - 1) * args.batch / out.decode_s)
            tokens[name] = out.sequences
    same = all(torch.equal(t, tokens["without"]) for t in tokens.values())
    print(f"same tokens: {same}; compiles: {[e.compile_counts['decode'] for e in engines.values()]} decode graphs")
    base = statistics.median(rates["without"])
    for name, values in rates.items():
        median = statistics.median(values)
        print(
            f"max_out_tokens={args.max_out} batch={args.batch} {name:12s} decode tokens/s {median:7.1f} "
            f"({min(values):.1f}..{max(values):.1f})  x{median / base:.2f}"
        )


if __name__ == "__main__":
    main()
