"""Goal 4: decode tokens/s at batch 1 on a ~100M HF Llama from a config (random weights, no EOS: every run makes
all its tokens).

Peers, alternated round by round on the same prompt, greedy, ``new`` tokens each (tokens/s = new tokens over
the whole ``generate`` call, the prefill included, alike for every peer):

- ``hf eager``: ``model.generate``;
- ``hf static + torch.compile``: Hugging Face's recipe, a static cache and ``torch.compile(model.forward,
  mode="reduce-overhead", fullgraph=True)`` (CUDA graphs);
- ``dscompile bf16`` and ``dscompile int8``: ``dscompile.init_inference`` (int8 weight-only: ``quant``);
- ``deepspeed kernel inject``: ``deepspeed.init_inference(replace_with_kernel_inject=True)``, in its own process
  (``deepspeed_decode.py``: its first call JIT-builds CUDA ops for minutes) alternated there with HF eager, so its
  ratio to dscompile is taken through HF eager. Skipped, with the reason, where DeepSpeed does not import.

Targets: dscompile / HF eager >= 2, dscompile / torch.compile static >= 1, dscompile / DeepSpeed >= 1.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpucheck.common import Ctx, deepspeed_missing, free_memory, millions, per_round, timed_once

SECTION = "decode"
HERE = Path(__file__).resolve().parent


def build_llama(d: dict[str, int], dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """A Llama from a config with seeded random weights; no BOS/EOS/PAD, so generation never stops early."""
    import transformers as tf

    config = tf.LlamaConfig(
        num_hidden_layers=d["layers"], hidden_size=d["hidden"], num_attention_heads=d["heads"], num_key_value_heads=d["heads"],
        intermediate_size=d["inter"], vocab_size=d["vocab"], max_position_embeddings=max(1024, d["prompt"] + d["new"]),
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def prompt_ids(d: dict[str, int], device: torch.device | str) -> torch.Tensor:
    return torch.randint(0, d["vocab"], (1, d["prompt"]), generator=torch.Generator().manual_seed(1)).to(device)


Runner = Callable[[], torch.Tensor]  # one generate call -> sequences


def _hf_eager(model: torch.nn.Module, ids: torch.Tensor, new: int) -> Runner:
    return lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def _hf_static_compiled(ctx: Ctx, model: torch.nn.Module, ids: torch.Tensor, new: int) -> Runner:
    model.generation_config.cache_implementation = "static"
    options = {"mode": "reduce-overhead", "fullgraph": True} if ctx.cuda else {}
    model.forward = torch.compile(model.forward, backend=ctx.inductor, **options)
    return lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def _dscompile(ctx: Ctx, model: torch.nn.Module, ids: torch.Tensor, new: int, **config: Any) -> Runner:
    import dscompile

    engine = dscompile.init_inference(model, dtype=ctx.dtype, max_out_tokens=ids.shape[1] + new, **ctx.dscompile_options(), **config)
    return lambda: engine.generate(ids, max_new_tokens=new)


def _rates(runners: dict[str, Runner], ctx: Ctx, new: int) -> dict[str, list[float]]:
    """New tokens per second of each peer, one value per round, the peers alternating within a round."""
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for index in range(ctx.sizes.rounds):
        for name, run in runners.items():
            _, seconds = timed_once(run, ctx)
            rates[name].append(new / seconds)
        if index >= 1 and ctx.left() < 0:
            break
    return rates


def _same_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many generated tokens two runs share from the start (bf16 peers may part after a near tie)."""
    n = min(a.shape[-1], b.shape[-1])
    differ = (a[0, :n] != b[0, :n]).nonzero()
    return int(differ[0]) if len(differ) else n


def _deepspeed(ctx: Ctx, d: dict[str, int]) -> tuple[str, str, list[float] | None]:
    """DeepSpeed kernel injection in a subprocess: (value, note, per-round DeepSpeed / HF eager ratios)."""
    missing = deepspeed_missing(ctx)
    if missing:
        return "not run", missing, None
    budget = ctx.left()
    if budget < 60:
        return "not run", f"{budget:.0f} s left; its JIT build takes minutes: run --only decode alone", None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "deepspeed.json"
        args = [sys.executable, str(HERE / "deepspeed_decode.py"), "--sizes", json.dumps(d), "--rounds", str(ctx.sizes.rounds), "--out", str(out)]
        if not ctx.cuda:
            args.append("--cpu")
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=budget)
        except subprocess.TimeoutExpired:
            return "not run", f"timed out after {budget:.0f} s (JIT build of DeepSpeed's inference ops?)", None
        if not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return "not available", f"exit {proc.returncode}: {tail[0][:160]}", None
        result = json.loads(out.read_text())
    if "error" in result:
        return "not available", result["error"][:160], None
    ratios = per_round(result["deepspeed"], result["hf eager"])
    value = f"{statistics.median(result['deepspeed']):.1f} tok/s"
    hf = statistics.median(result["hf eager"])
    return value, f"{result['dtype']}; its own process: HF eager {hf:.1f} tok/s there; first call {result['first_s']:.0f} s", ratios


def run(ctx: Ctx) -> None:
    d = ctx.sizes.decode
    new = d["new"]
    ids = prompt_ids(d, ctx.device)
    base = build_llama(d, ctx.dtype, ctx.device)
    params = sum(p.numel() for p in base.parameters())
    label = f"llama ({millions(params)}) batch 1, {d['prompt']} + {new} tokens"
    state = base.state_dict()

    def fresh() -> torch.nn.Module:
        model = build_llama(d, ctx.dtype, ctx.device)
        model.load_state_dict(state)
        return model

    makers: dict[str, Callable[[], Runner]] = {
        "hf eager": lambda: _hf_eager(base, ids, new),
        "hf static + torch.compile": lambda: _hf_static_compiled(ctx, fresh(), ids, new),
        "dscompile bf16" if ctx.cuda else "dscompile fp32": lambda: _dscompile(ctx, fresh(), ids, new),
        "dscompile int8": lambda: _dscompile(ctx, fresh(), ids, new, quant={"enabled": True, "weight": {"num_bits": 8}}),
    }
    runners: dict[str, Runner] = {}
    reference = None
    for name, make in makers.items():
        if ctx.left() < 0:
            ctx.table.add(SECTION, f"{label}: {name}", "skipped", "section time spent")
            continue
        try:
            runner = make()
            sequences, first = timed_once(runner, ctx)
        except Exception as exc:
            ctx.table.add(SECTION, f"{label}: {name}", "ERROR", f"{type(exc).__name__}: {str(exc)[:140]}")
            continue
        reference = sequences if reference is None else reference
        ctx.table.add(SECTION, f"{label}: {name} first call", f"{first:.1f} s", f"first {_same_prefix(sequences[:, d['prompt']:], reference[:, d['prompt']:])} "
                      f"of {new} tokens as HF eager's")
        runners[name] = runner
    rates = _rates(runners, ctx, new)
    for name, values in rates.items():
        ctx.table.add(SECTION, f"{label}: {name}", f"{statistics.median(values):.1f} tok/s", f"{len(values)} rounds")
    ours = [name for name in rates if name.startswith("dscompile")]
    for name in ours:
        for peer, target in (("hf eager", ">= 2.0"), ("hf static + torch.compile", ">= 1.0")):
            if peer in rates:
                ctx.table.ratio(SECTION, f"{name} / {peer}", per_round(rates[name], rates[peer]), target, "goal 4; tokens/s, higher is better")
    del runners
    free_memory(ctx)
    value, note, ds_ratios = _deepspeed(ctx, d)
    ctx.table.add(SECTION, f"{label}: deepspeed kernel inject", value, note)
    if ds_ratios and "hf eager" in rates:
        ds_vs_hf = statistics.median(ds_ratios)
        for name in ours:
            chained = [r / ds_vs_hf for r in per_round(rates[name], rates["hf eager"])]
            ctx.table.ratio(SECTION, f"{name} / deepspeed kernel inject", chained, ">= 1.0", "through HF eager (DeepSpeed ran in its own process)")
