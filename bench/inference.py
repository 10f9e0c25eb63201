"""Generation speed: dscompile ``init_inference`` against Hugging Face eager ``generate`` and
``torch.compile(model.forward)`` with Hugging Face's static cache.

    python bench/inference.py [--arch llama|gpt2] [--size 100m|tiny] [--batch 1 8] [--new 128] [--repeats 3]

A ~100M-parameter model built from a config (random weights, no download). For each batch size the
contenders run in alternation, ``--repeats`` times each after one warm-up (which compiles), on the
same prompts, greedy: new tokens per second (all sequences) and first-token latency, median with
min..max, and each contender's ratio to HF eager. dscompile's variants: fp32, fp32 with the
inference fusion passes (``replace_with_kernel_inject``), and int8 weights (``--quant``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SIZES = {
    # ~100M parameters: 12 layers, hidden 768, vocab 32000 (GPT-2-small-like / a small Llama)
    "100m": dict(layers=12, hidden=768, heads=12, inter=2048, vocab=32000),
    "tiny": dict(layers=2, hidden=64, heads=4, inter=128, vocab=256),
}


def build(arch: str, size: str) -> torch.nn.Module:
    import transformers as tf

    s = SIZES[size]
    if arch == "gpt2":
        config = tf.GPT2Config(
            n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"], vocab_size=s["vocab"], n_positions=1024, bos_token_id=None, eos_token_id=None
        )
        model = tf.GPT2LMHeadModel(config)
    else:
        config = tf.LlamaConfig(
            num_hidden_layers=s["layers"],
            hidden_size=s["hidden"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["heads"],
            intermediate_size=s["inter"],
            vocab_size=s["vocab"],
            max_position_embeddings=1024,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        model = tf.LlamaForCausalLM(config)
    return model.eval()


Runner = Callable[[torch.Tensor], tuple[float, float]]  # prompt -> (first-token s, total s)


def hf_eager(model: torch.nn.Module, new: int) -> Runner:
    def run(ids: torch.Tensor) -> tuple[float, float]:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, do_sample=False)
        return first, time.perf_counter() - start

    return run


def hf_static_compiled(model: torch.nn.Module, new: int) -> Runner:
    """Hugging Face's recipe: static cache + ``torch.compile(model.forward)`` (Inductor)."""
    compiled = torch.compile(model.forward)

    original = model.forward
    model.forward = compiled

    def run(ids: torch.Tensor) -> tuple[float, float]:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, cache_implementation="static")
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, do_sample=False, cache_implementation="static")
        return first, time.perf_counter() - start

    run.restore = lambda: setattr(model, "forward", original)  # type: ignore[attr-defined]
    return run


def dscompile_engine(model: torch.nn.Module, new: int, prompt: int, **config: Any) -> Runner:
    import dscompile

    engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=prompt + new, **config)

    def run(ids: torch.Tensor) -> tuple[float, float]:
        out = engine.generate(ids, max_new_tokens=new, return_dict_in_generate=True)
        return out.first_token_s, out.first_token_s + out.decode_s

    return run


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} ({min(values):.2f}..{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--size", choices=tuple(SIZES), default="100m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quant", action="store_true", help="also int8 weight-only dscompile")
    parser.add_argument("--skip-hf-compile", action="store_true", help="leave out torch.compile(model.forward) (its compile is slow on CPU)")
    parser.add_argument("--no-fused", action="store_true", help="leave out dscompile with replace_with_kernel_inject (one compile less)")
    args = parser.parse_args()
    torch.manual_seed(0)
    params = sum(p.numel() for p in build(args.arch, args.size).parameters())
    print(f"{args.arch} {args.size}: {params / 1e6:.1f}M parameters; prompt {args.prompt}, {args.new} new tokens, threads {torch.get_num_threads()}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for batch in args.batch:
        ids = torch.randint(0, SIZES[args.size]["vocab"], (batch, args.prompt), generator=torch.Generator().manual_seed(1))
        contenders: dict[str, Runner] = {}
        with torch.no_grad():
            base = build(args.arch, args.size)
            state = base.state_dict()

            def fresh(state: dict = state) -> torch.nn.Module:
                m = build(args.arch, args.size)
                m.load_state_dict(state)
                return m

            contenders["hf eager"] = hf_eager(base, args.new)
            if not args.skip_hf_compile:
                contenders["hf static+torch.compile"] = hf_static_compiled(fresh(), args.new)
            contenders["dscompile fp32"] = dscompile_engine(fresh(), args.new, args.prompt)
            if not args.no_fused:
                contenders["dscompile fp32 fused"] = dscompile_engine(fresh(), args.new, args.prompt, replace_with_kernel_inject=True)
            if args.quant:
                contenders["dscompile int8"] = dscompile_engine(
                    fresh(), args.new, args.prompt, quant={"enabled": True, "weight": {"num_bits": 8, "q_groups": 64}}
                )
            firsts: dict[str, list[float]] = {k: [] for k in contenders}
            rates: dict[str, list[float]] = {k: [] for k in contenders}
            for name, run in contenders.items():  # warm-up: compiles
                start = time.perf_counter()
                run(ids)
                print(f"  warm-up {name}: {time.perf_counter() - start:.1f} s", flush=True)
            for _ in range(args.repeats):
                for name, run in contenders.items():  # alternate, so load changes hit every contender
                    first, total = run(ids)
                    firsts[name].append(1000 * first)
                    rates[name].append(batch * args.new / total)
        print(f"load average after batch {batch}: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(
            f"batch {batch}:  {'contender':<26} {'tokens/s median (min..max)':>30} {'first token ms':>28}  "
            "ratio to hf eager, per round (median, min..max)  best/best"
        )
        for name in contenders:
            # per round: the contenders ran back to back, so a round's ratio compares them under the same load
            ratio = [r / base for r, base in zip(rates[name], rates["hf eager"])]
            best = max(rates[name]) / max(rates["hf eager"])
            print(
                f"          {name:<26} {spread(rates[name]):>30} {spread(firsts[name]):>28}  "
                f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}..{max(ratio):.2f}){'':>24}{best:.2f}x"
            )


if __name__ == "__main__":
    main()
