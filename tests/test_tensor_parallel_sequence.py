"""Megatron's sequence parallelism under tensor parallelism (``tensor_parallel.sequence_parallel``) on 2 gloo ranks.

Between the split blocks the residual stream holds each rank's sequence chunk: each block's all-reduce becomes a
reduce-scatter along the sequence, an all-gather goes before the column-parallel linears, the norms and residual
adds run on the chunk and their weights' gradients are summed over the group. Each model trains under TP=2 with
sequence parallelism and on one process from the same weights and batches: the losses, the gathered gradients
and the parameters after SGD steps must agree within 1e-5 (fp32), for a length TP divides and one it does not
(padded between blocks), and an eval batch of 5 tokens captured anew; the split graph must hold the reduce-scatters
and all-gathers and no block all-reduce, and the dump of the compiled forward graph their functional collectives.
On 4 ranks (slow): TP=2 × DP=2 with ZeRO 0-3, clipped, against one process on both batches. Refused by name:
sequence_parallel without a TP group, and with pipeline stages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

ZOO = {
    "gpt": {"d_model": 16, "n_heads": 2, "n_layers": 2, "vocab_size": 40},
    "llama": {"d_model": 16, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2, "vocab_size": 40, "hidden_dim": 32},
}
STEPS = 3
LR = 0.1
# (model, sequence length, lowering (None: the default, Inductor), vocab_parallel_lm_head)
RUNS = [
    ("gpt", 8, "eager", False),
    ("llama", 8, None, False),  # GQA, rotary, RMSNorm; the default lowering, dumped
    ("gpt", 7, "eager", False),  # 7 tokens on 2 ranks: padded to 8 between the blocks
    ("hf_gpt2", 7, "eager", True),  # Conv1D's [batch * sequence] rows, uneven, with the vocabulary-parallel LM head
]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _hf_gpt2() -> torch.nn.Module:
    import transformers

    torch.manual_seed(1)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(config)


def _setup(name: str, seq_len: int) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """The model to split, its single-process twin, and ``batch(step) -> (args, kwargs)``."""
    from dscompile.zoo import build, make_batch

    if name == "hf_gpt2":

        def hf_batch(step: int) -> tuple[tuple, dict]:
            ids = torch.randint(0, 50, (2, seq_len), generator=torch.Generator().manual_seed(step))
            return (), {"input_ids": ids, "labels": ids}

        return _hf_gpt2(), _hf_gpt2(), hf_batch
    case, ref = build(name, seed=3, seq_len=seq_len, **ZOO[name]), build(name, seed=3, seq_len=seq_len, **ZOO[name])
    return case.model, ref.model, lambda step: (make_batch(case, seed=step), {})


def _loss(out: Any) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out


def _graph_nodes(module: Any) -> list[dict[str, int]]:
    """How many of each sequence- and tensor-parallel op each split graph holds."""
    from dscompile.runtime import tensor_parallel as rt

    out = []
    for gm in module.split_graphs():
        counts = dict.fromkeys(("sp_reduce_scatter", "sp_gather", "sp_scatter", "tp_reduce", "tp_copy"), 0)
        for node in gm.graph.nodes:
            for name in counts:
                if node.op == "call_function" and node.target is getattr(rt, name):
                    counts[name] += 1
        out.append(counts)
    return out


def _dumped_forward_collectives(directory: Path) -> list[dict[str, int]]:
    """The functional collectives of each compiled forward graph in the dump, after its last pass."""
    out = []
    for graph in sorted(p for p in directory.iterdir() if p.is_dir() and "forward" in p.name):
        last = sorted(s for s in graph.iterdir() if (s / "summary.json").exists())[-1]
        out.append(json.loads((last / "summary.json").read_text())["collectives"])
    return out


def train_and_compare(rank: int, world: int, dump_dir: str) -> dict[str, Any]:
    import dscompile

    out: dict[str, Any] = {}
    for name, seq_len, lower, vocab in RUNS:
        model, ref, batch = _setup(name, seq_len)
        cfg: dict[str, Any] = {
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True, "vocab_parallel_lm_head": vocab},
        }
        if lower is not None:
            cfg["lower"] = lower
        else:
            cfg["dump"] = f"{dump_dir}/rank{rank}"
        engine, *_ = dscompile.initialize(model=model, config=cfg)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        losses, ref_losses, grad_err, logits_err = [], [], 0.0, 0.0
        for step in range(STEPS):
            args, kwargs = batch(step)
            out_tp = engine(*args, **kwargs)
            engine.backward(_loss(out_tp))
            out_ref = ref(*args, **kwargs)
            _loss(out_ref).backward()
            grads = engine.extension("tensor_parallel").full_gradients()
            grad_err = max(grad_err, *(_relative(grads[n], p.grad) for n, p in ref.named_parameters()))
            if hasattr(out_tp, "logits"):  # the returned logits: gathered over the sequence and the vocabulary
                logits_err = max(logits_err, float((out_tp.logits.detach() - out_ref.logits.detach()).abs().max()))
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(float(_loss(out_tp).detach()))
            ref_losses.append(float(_loss(out_ref).detach()))
        full = engine.full_parameters()
        ext = engine.extension("tensor_parallel")
        eval_err = None
        if name == "gpt" and seq_len == 8:  # an evaluation batch of 5 tokens: captured and split anew, padded to 6
            args, _ = batch(STEPS)
            short = tuple(t[:, :5] for t in args)
            engine.eval()
            ref.eval()
            with torch.no_grad():
                eval_err = abs(float(engine(*short)) - float(ref(*short)))
            engine.train()
            ref.train()
        out[f"{name}/{seq_len}/{lower or 'inductor'}/{vocab}"] = {
            "eval_err": eval_err,
            "losses": losses,
            "ref_losses": ref_losses,
            "grad_err": grad_err,
            "logits_err": logits_err,
            "param_err": max(_relative(full[n], p.detach()) for n, p in ref.named_parameters()),
            "blocks": len(ext.plan.split),
            "sequence": ext.plan.sequence_parallel,
            "counters": ext.counters(),
            "nodes": _graph_nodes(ext.module),
            "dumped": _dumped_forward_collectives(Path(cfg["dump"])) if "dump" in cfg else None,
        }
    return out


@pytest.mark.distributed
@requires_backend("gloo")
def test_sequence_parallel_tp2_equals_single_process(tmp_path) -> None:
    pytest.importorskip("transformers")
    results = run_distributed_or_fail(train_and_compare, 2, str(tmp_path), timeout=600)
    for result in results:
        assert len(result) == len(RUNS)
        for key, r in result.items():
            seq = r["sequence"]
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6), key
            assert r["grad_err"] < 1e-5, (key, r["grad_err"])
            assert r["param_err"] < 1e-5, (key, r["param_err"])
            assert r["logits_err"] < 1e-5, (key, r["logits_err"])
            assert r["eval_err"] is None or r["eval_err"] < 1e-5, (key, r["eval_err"])
            blocks = r["blocks"]
            assert blocks == 4, key  # 2 layers: attention and MLP each
            # every block's all-reduce became a reduce-scatter along the sequence; blocks after the first read an all-gather
            # (the first reads the whole embedding output through tp_copy), and the LM head (the reader) the gathered sequence
            assert len(r["nodes"]) == (2 if r["eval_err"] is not None else 1), key  # the eval batch: a second split graph
            for nodes in r["nodes"]:
                assert nodes["tp_reduce"] == 0 and nodes["sp_reduce_scatter"] == blocks, (key, nodes)
                assert nodes["sp_gather"] == blocks - 1 + 1 and nodes["tp_copy"] >= 1, (key, nodes)
                assert nodes["sp_scatter"] == 1, (key, nodes)  # the embedding output cut at the first residual add
            assert seq["seq_len"] == int(key.split("/")[1]) and seq["padded_to"] == 8 and not seq["all_reduces_kept"], (key, seq)
            assert r["counters"]["sequence_parallel"] is True and r["counters"]["sp_reduce_scatters"] == blocks, key
            # the norms after the first block's input run on chunks: their weights' gradients are summed over the group
            norms = [n for n in seq["gradients_summed"] if "norm" in n or "ln" in n]
            assert len(norms) >= 2 * 2, (key, seq["gradients_summed"])
            if r["dumped"] is not None:  # the compiled forward graph: reduce-scatters and all-gathers, no all-reduce
                assert r["dumped"], key
                collectives = {op: n for graph in r["dumped"] for op, n in graph.items()}
                assert any("reduce_scatter" in op for op in collectives) and any("all_gather" in op for op in collectives), collectives
                assert not any("all_reduce" in op for op in collectives), collectives


def test_sequence_parallel_key_and_its_refusal_with_pipeline_stages() -> None:
    import dscompile
    from dscompile.config import load_config
    from dscompile.errors import DSCompileConfigError
    from dscompile.zoo import build

    assert load_config({"tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}}).sections["tensor_parallel"].sequence_parallel is True
    assert load_config({"tensor_parallel": {"autotp_size": 2}}).sections["tensor_parallel"].sequence_parallel is False  # Megatron's default
    with pytest.raises(DSCompileConfigError, match="tensor_parallel.sequence_parallel"):  # no TP group to shard over: not ignored
        load_config({"tensor_parallel": {"sequence_parallel": True}})
    case = build("gpt", seed=0, seq_len=8, **ZOO["gpt"])
    config = {"pipeline": {"stages": 2}, "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}}
    with pytest.raises(DSCompileConfigError, match="tensor_parallel.sequence_parallel"):
        dscompile.initialize(model=case.model, config=config | {"optimizer": {"type": "SGD", "params": {"lr": LR}}})


CLIP = 0.05  # below every step's gradient norm here: the clipping really scales


def tp_sp_times_zero(rank: int, world: int) -> dict[str, Any]:
    """TP=2 with sequence parallelism × DP=2, plain and ZeRO-1/2/3 over the DP group, 7 tokens (padded), clipped SGD:
    each DP replica trains on its own batch; the parameters must equal one process training on both batches."""
    import dscompile
    from dscompile.zoo import build, make_batch

    sizes = {"seq_len": 7, "d_model": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 40}
    out: dict[str, Any] = {}
    for zero in (0, 1, 2, 3):
        case, ref = build("gpt", seed=3, **sizes), build("gpt", seed=3, **sizes)
        cfg: dict[str, Any] = {"optimizer": {"type": "SGD", "params": {"lr": LR}}, "lower": "eager", "gradient_clipping": CLIP}
        cfg["tensor_parallel"] = {"autotp_size": 2, "sequence_parallel": True}
        if zero:
            cfg["zero_optimization"] = {"stage": zero}
        engine, *_ = dscompile.initialize(model=case.model, config=cfg)
        groups = engine.process_groups
        ref_opt = torch.optim.SGD(ref.model.parameters(), lr=LR)
        norms = []
        for step in range(STEPS):
            batches = [make_batch(case, seed=10 * step + dp) for dp in range(groups.dp_size)]
            engine.backward(engine(*batches[groups.dp_rank]))
            engine.step()
            (sum(ref.model(*b) for b in batches) / len(batches)).backward()
            norms.append((engine.get_global_grad_norm(), float(torch.nn.utils.clip_grad_norm_(ref.model.parameters(), CLIP))))
            ref_opt.step()
            ref_opt.zero_grad()
        full = engine.full_parameters()
        out[zero] = {
            "param_err": max(_relative(full[n], p.detach()) for n, p in ref.model.named_parameters()),
            "norms": norms,
            "zero_world": engine.zero.world if engine.zero is not None else None,
            "reduce_scatters": engine.extension("tensor_parallel").plan.sequence_parallel["reduce_scatters"],
        }
    return out


@pytest.mark.distributed
@pytest.mark.slow
@requires_backend("gloo")
def test_sequence_parallel_tp2_times_zero_dp2_on_4_ranks() -> None:
    for result in run_distributed_or_fail(tp_sp_times_zero, 4, timeout=600):
        for zero, r in result.items():
            assert r["zero_world"] == (2 if zero else None) and r["reduce_scatters"] == 2, (zero, r)
            assert r["param_err"] < 1e-5, (zero, r["param_err"])
            for norm, ref_norm in r["norms"]:  # the global norm (norm weights' gradients summed in the graph, counted once)
                assert norm == pytest.approx(ref_norm, rel=1e-5) and ref_norm > CLIP, (zero, norm, ref_norm)
