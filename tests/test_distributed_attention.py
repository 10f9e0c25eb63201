"""DeepSpeed's ``DistributedAttention`` (``dscompile.sequence.layer``) on 2 gloo ranks.

Scripts doing Ulysses by hand feed each rank its chunk of the sequence and wrap their attention in it.
Each rank's output chunk and query/key/value gradients must be the single-process attention's chunk
(fp32, 1e-5), eagerly and under ``torch.compile(backend="dscompile")`` (Inductor lowering, the all-to-alls
in the compiled graphs), in both of DeepSpeed's layouts and call forms; a small GPT written that way
must train under ``dscompile.initialize`` like one process on the whole sequence; and the engine must
refuse to shard such a model a second time (``sequence_parallel_size`` > 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

B, S, H, D = 2, 8, 4, 8  # batch, whole sequence, heads, head dim
TOL = 1e-5


class CausalSDPA(nn.Module):
    """A local attention over [S, B, h, D] (``batch_first=False``) or [B, S, h, D] inputs."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        order = (0, 2, 1, 3) if self.batch_first else (1, 2, 0, 3)  # -> [B, h, S, D]
        back = (0, 2, 1, 3) if self.batch_first else (2, 0, 1, 3)
        q, k, v = (x.permute(order) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(back)


def _rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


def _reference(batch_first: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
               rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Output and q/k/v gradients of the single-process attention on the whole sequence."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    qr, kr = q, k
    if rotary is not None:
        cos, sin = (r.permute(1, 0, 2, 3) for r in rotary)
        qr, kr = _rotary(q, cos, sin), _rotary(k, cos, sin)
    out = CausalSDPA(batch_first)(qr, kr, v)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _run_chunked(attn: Any, batch_first: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                 rank: int, call: Any) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """This rank's chunk through ``attn``: its output and its chunk's gradients."""
    dim = 1 if batch_first else 0
    mine = [x.chunk(2, dim)[rank].detach().clone().requires_grad_() for x in (q, k, v)]
    out = call(attn, *mine)
    (out * w.chunk(2, dim)[rank]).sum().backward()
    return out.detach(), *(x.grad for x in mine)


def _err(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], dim: int, rank: int) -> float:
    return max(float((g - x.chunk(2, dim)[rank]).abs().max()) for g, x in zip(got, want))


# (name, constructor scatter/gather, batch first, how forward is called)
CASES: list[tuple[str, tuple[int, int], bool, Any]] = [
    ("seq_first", (2, 0), False, lambda a, q, k, v: a(q, k, v, 1)),  # current DeepSpeed: batch_dim_idx=1
    ("seq_first_old_call", (2, 0), False, lambda a, q, k, v: a(q, k, v)),  # before batch_dim_idx: scatter 2, gather 0
    ("batch_first", (2, 1), True, lambda a, q, k, v: a(q, k, v, batch_dim_idx=0)),
    ("batch_first_gather_0", (2, 0), True, lambda a, q, k, v: a(q, k, v, 0)),  # Megatron-DeepSpeed's: gather_idx unused
]


def attention_chunks(rank: int, world: int, dump: str) -> dict[str, Any]:
    import torch.distributed as dist

    from dscompile.sequence.layer import DistributedAttention

    torch.manual_seed(0)
    seq_first = [torch.randn(S, B, H, D) for _ in range(4)]
    out: dict[str, Any] = {}
    for name, (scatter, gather), batch_first, call in CASES:
        q, k, v, w = (x.transpose(0, 1).contiguous() for x in seq_first) if batch_first else seq_first
        attn = DistributedAttention(CausalSDPA(batch_first), dist.group.WORLD, scatter_idx=scatter, gather_idx=gather)
        got = _run_chunked(attn, batch_first, q, k, v, w, rank, call)
        out[name] = _err(got, _reference(batch_first, q, k, v, w), 1 if batch_first else 0, rank)
    # rotary_pos_emb (current DeepSpeed, batch first): cos/sin of the whole sequence, applied after the all-to-all
    q, k, v, w = (x.transpose(0, 1).contiguous() for x in seq_first)
    angles = torch.arange(S).float()[:, None] * torch.linspace(0.1, 1.0, D // 2).repeat(2)[None]
    rotary = (angles.cos()[:, None, None], angles.sin()[:, None, None])  # [S, 1, 1, D]: permuted to [1, S, 1, D]
    attn = DistributedAttention(CausalSDPA(True), dist.group.WORLD, 2, 1)
    got = _run_chunked(attn, True, q, k, v, w, rank, lambda a, q_, k_, v_: a(q_, k_, v_, 0, rotary))
    out["rotary"] = _err(got, _reference(True, q, k, v, w, rotary), 1, rank)
    # compiled with the dscompile backend (default lowering: Inductor); dump only writes the graphs out
    from torch._dynamo.utils import counters

    for name, (scatter, gather), batch_first, call in (CASES[0], CASES[2]):
        torch._dynamo.reset()
        counters.clear()
        q, k, v, w = (x.transpose(0, 1).contiguous() for x in seq_first) if batch_first else seq_first
        attn = DistributedAttention(CausalSDPA(batch_first), dist.group.WORLD, scatter_idx=scatter, gather_idx=gather)
        compiled = torch.compile(attn, backend="dscompile", options={"dump": f"{dump}/{name}/rank{rank}"})
        got = _run_chunked(compiled, batch_first, q, k, v, w, rank, call)
        root = Path(dump) / name / f"rank{rank}"
        graphs = sorted(p.name for p in root.iterdir() if p.is_dir())

        def all_to_alls(graph: str, root: Path = root) -> int:
            final = sorted((root / graph).iterdir())[-1]
            return (final / "code.py").read_text().count("_c10d_functional.all_to_all_single.default(")

        out[f"compiled_{name}"] = {
            "err": _err(got, _reference(batch_first, q, k, v, w), 1 if batch_first else 0, rank),
            "graphs": graphs,
            "graph_breaks": sum(counters["graph_break"].values()),
            "forward_all_to_alls": all_to_alls("graph_0.forward"),
            "backward_all_to_alls": all_to_alls("graph_0.backward"),
        }
    return out


@pytest.mark.distributed
@requires_backend("gloo")
def test_each_rank_gets_the_single_process_attention_chunk(tmp_path: Path) -> None:
    for rank, result in enumerate(run_distributed_or_fail(attention_chunks, 2, str(tmp_path), timeout=300)):
        for name in [c[0] for c in CASES] + ["rotary"]:
            assert result[name] < TOL, (rank, name, result[name])
        for name in ("seq_first", "batch_first"):
            r = result[f"compiled_{name}"]
            assert r["err"] < TOL, (rank, name, r)
            assert r["graph_breaks"] == 0 and r["graphs"] == ["graph_0.backward", "graph_0.dynamo", "graph_0.forward", "graph_0.joint"], r
            assert r["forward_all_to_alls"] == 4 and r["backward_all_to_alls"] == 4, r  # q, k, v and the output's


# --------------------------------------------------------------------------------------------- a ported script
VOCAB, D_MODEL, LAYERS, STEPS, LR = 32, 16, 2, 3, 0.1


class Block(nn.Module):
    def __init__(self, distributed: bool) -> None:
        super().__init__()
        from dscompile.sequence.layer import DistributedAttention

        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 2 * D_MODEL), nn.GELU(), nn.Linear(2 * D_MODEL, D_MODEL))
        local = CausalSDPA(batch_first=True)
        self.attn = DistributedAttention(local, None, scatter_idx=2, gather_idx=1) if distributed else local
        self.distributed = distributed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, H, D_MODEL // H).unbind(2)
        a = self.attn(q, k, v, 0) if self.distributed else self.attn(q, k, v)
        x = x + self.proj(a.reshape(b, s, D_MODEL))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Takes this rank's chunk of the token ids and their positions (a Megatron-DeepSpeed-style script)."""

    def __init__(self, distributed: bool) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(S, D_MODEL)
        self.blocks = nn.ModuleList(Block(distributed) for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())


def ported_script(rank: int, world: int) -> dict[str, Any]:
    import dscompile as deepspeed  # the port: `import deepspeed` becomes this

    torch.manual_seed(0)
    model = TinyGPT(distributed=True)
    reference = TinyGPT(distributed=False)
    reference.load_state_dict(model.state_dict())
    config = {"train_micro_batch_size_per_gpu": B, "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    chunk = S // world
    mine = slice(rank * chunk, (rank + 1) * chunk)
    losses, ref_losses = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)  # the same batch on every rank
        ids, targets = torch.randint(VOCAB, (B, S), generator=g), torch.randint(VOCAB, (B, S), generator=g)
        positions = torch.arange(S).expand(B, S)
        loss = engine(ids[:, mine], positions[:, mine], targets[:, mine])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / world)
        ref_loss = reference(ids, positions, targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(ref_loss))
    full = engine.full_parameters()
    param_err = {n: float((full[n] - p.detach()).norm() / p.detach().norm()) for n, p in reference.named_parameters()}
    try:  # dscompile's own Ulysses on top would shard the chunks again
        deepspeed.initialize(model=TinyGPT(distributed=True), config={**config, "sequence_parallel_size": 2})
        refused = ""
    except DSCompileConfigError as exc:
        refused = str(exc)
    return {"losses": losses, "ref_losses": ref_losses, "param_err": max(param_err.values()), "refused": refused}


@pytest.mark.distributed
@requires_backend("gloo")
def test_a_script_written_for_distributed_attention_trains_like_one_process() -> None:
    for result in run_distributed_or_fail(ported_script, 2, timeout=300):
        for loss, ref in zip(result["losses"], result["ref_losses"]):
            assert abs(loss - ref) <= TOL * abs(ref), result
        assert result["param_err"] < TOL, result
        assert "sequence_parallel_size" in result["refused"] and "DistributedAttention" in result["refused"], result


# --------------------------------------------------------------------------------------------- one process
def test_the_sequence_parallel_pass_refuses_a_model_that_already_runs_ulysses() -> None:
    from dscompile.config import load_config
    from dscompile.passes.sequence_parallel import SequenceParallelExtension

    class Engine:  # what configure reads of an engine
        config = load_config({"sequence_parallel_size": 2})
        module = TinyGPT(distributed=True)

    with pytest.raises(DSCompileConfigError, match="sequence_parallel_size.*blocks.0.attn is a DistributedAttention.*leave sequence_parallel_size at 1"):
        SequenceParallelExtension(2).configure(Engine())  # type: ignore[arg-type]


def test_deepspeed_import_paths_and_refusals() -> None:
    import dscompile as deepspeed
    from dscompile.sequence.layer import DistributedAttention

    assert deepspeed.sequence.layer.DistributedAttention is DistributedAttention
    with pytest.raises(DSCompileNotSupportedError, match="sp_stream"):
        DistributedAttention(CausalSDPA(True), None, sp_stream=object())
    x = torch.randn(B, S, H, D)
    one = DistributedAttention(CausalSDPA(True), None, 2, 1)  # no process group: one rank, the local attention alone
    assert torch.equal(one(x, x, x, 0), CausalSDPA(True)(x, x, x))
    with pytest.raises(ValueError, match="batch_dim_idx must be 0"):
        one(x, x, x, 2)
    one._world = 3  # as on a group of 3 ranks: 4 heads do not split
    with pytest.raises(DSCompileNotSupportedError, match="4 heads over a sequence group of 3 ranks"):
        one(x, x, x, 0)
