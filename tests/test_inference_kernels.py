"""Kernel injection's rotary and KV-cache attention passes (``passes/inference_rotary.py``,
``passes/inference_cache_attention.py``): found in the captured prefill/decode graphs of Hugging Face
models built from configs, nothing per architecture.

The contract, in fp32: greedy tokens equal ``model.generate``'s exactly for 32 tokens, logits within
1e-5 of Hugging Face's and of a full recomputation, the decode graph compiled once, and the number of
fused applications per graph asserted (2 layers: 2 rotary applications per layer, Q and K, and one
cache attention per layer). GPT-2 and OPT have no rotary embedding: the rotary pass finds nothing and
leaves the graph as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dscompile
from dscompile.kernels.cache_attention import cache_attention, valid_prefix
from dscompile.kernels.rotary import rotary_embedding, rotary_embedding_unfused
from dscompile.runtime.inference.ops import CACHE_ATTENTION

pytest.importorskip("transformers")

from test_inference import check_against_hf, left_padded_batch, pass_messages, tiny  # noqa: E402

LOGGERS = ("inference_rotary", "inference_cache_attention")


def fused_counts(messages: list[str]) -> list[tuple[int, int]]:
    """``(rotary applications, cache attentions)`` fused per graph, in compile order."""
    rotary = [int(m.split(": ")[1].split()[0]) for m in messages if "rotary embeddings fused" in m]
    attention = [int(m.split(": ")[1].split()[0]) for m in messages if "attentions over the KV cache fused" in m]
    return list(zip(rotary, attention))


@pytest.mark.parametrize(
    "arch,lower,rotary",
    [
        pytest.param("llama", None, 4, marks=pytest.mark.slow),
        ("llama", "eager", 4),
        ("mistral", "eager", 4),
        ("gpt_neox", "eager", 4),
        ("gpt2", "eager", 0),
        ("opt", "eager", 0),
    ],
)
def test_rotary_and_cache_attention_fused_match_hf(arch: str, lower: str | None, rotary: int) -> None:
    """Prefill and decode graphs: ``rotary`` fused rotary calls (Q and K of 2 layers; partial rotary for GPT-NeoX)
    and 2 cache attentions each; HF's exact tokens, logits within 1e-5, one decode graph (a second prompt
    length reuses it). Llama under the default lowering (Inductor on CPU) and the eager one."""
    messages = check_against_hf(arch, lower, second_request=lower == "eager" and arch == "llama", kernel_inject=True, loggers=LOGGERS)
    assert fused_counts(messages) == [(rotary, 2)] * 2, messages


def test_no_rotary_graph_left_unchanged(tmp_path: Path) -> None:
    """GPT-2: the rotary pass's output graph is its input graph, line for line (dump of prefill and decode)."""
    engine = dscompile.init_inference(tiny("gpt2"), dtype=torch.float32, max_out_tokens=16, lower="eager", replace_with_kernel_inject=True, dump=str(tmp_path))
    ids, mask = left_padded_batch()
    engine.generate(ids, attention_mask=mask, max_new_tokens=2)
    graphs = sorted(tmp_path.glob("graph_*.dynamo"))
    assert len(graphs) == 2, graphs
    for graph in graphs:
        steps = sorted(p.name for p in graph.iterdir())
        rotary = next(s for s in steps if s.endswith("fuse_rotary_embedding"))
        before = steps[steps.index(rotary) - 1]
        assert (graph / rotary / "code.py").read_text() == (graph / before / "code.py").read_text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_rotary_kernel_equals_rotate_half_bitwise(dtype: torch.dtype, rotary_dim: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 5, 16, generator=g).to(dtype)
    d = rotary_dim or 16
    angles = torch.randn(2, 1, 5, d // 2, generator=g).repeat(1, 1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert torch.equal(rotary_embedding(x, cos, sin, rotary_dim), rotary_embedding_unfused(x, cos, sin, rotary_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def _spellings(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rotary as models write it, in several spellings, and two near misses the pass must not take."""
    a = q * cos + _rotate_half(q) * sin  # Llama
    b = sin * _rotate_half(k) + cos * k  # operands swapped
    half = k.shape[-1] // 2
    c = k * cos + torch.cat((-k.narrow(-1, half, half), k.narrow(-1, 0, half)), dim=-1) * sin  # narrow
    rot, rest = q[..., :8], q[..., 8:]  # partial rotary, GPT-NeoX
    d = torch.cat([rot * cos[..., :8] + _rotate_half(rot) * sin[..., :8], rest], dim=-1)
    wrong_sign = q * cos + torch.cat((q[..., half:], -q[..., :half]), dim=-1) * sin  # cat(x2, -x1): not rotate_half
    other_x = q * cos + _rotate_half(k) * sin  # rotates another tensor than it scales
    return a, b, c, d, wrong_sign, other_x


def test_rotary_pass_finds_spellings_and_skips_near_misses() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 3, 16, generator=g), torch.randn(2, 4, 3, 16, generator=g)
    angles = torch.randn(2, 1, 3, 8, generator=g).repeat(1, 1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    compiled = torch.compile(_spellings, backend="dscompile", options={"pipeline": "fuse_rotary_embedding,dce,lower(eager)"})
    with torch.no_grad(), pass_messages("inference_rotary") as messages:
        out = compiled(q, k, cos, sin)
    assert [m.split(": ")[1] for m in messages] == ["4 rotary embeddings fused"], messages
    for got, want in zip(out, _spellings(q, k, cos, sin)):
        assert torch.equal(got, want)


def test_cache_attention_reads_only_the_valid_prefix() -> None:
    """GQA heads grouped against their KV head, a mask per batch row or per head; slots past the last
    attended column are never read (NaN there leaves the output finite, where SDPA over the cache is NaN)."""
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, slots, dim = 2, 4, 2, 16, 8
    q = torch.randn(batch, heads, 1, dim, generator=g)
    k, v = torch.randn(batch, kv_heads, slots, dim, generator=g), torch.randn(batch, kv_heads, slots, dim, generator=g)
    mask = torch.zeros(batch, 1, 1, slots, dtype=torch.bool)
    mask[0, ..., :6] = True
    mask[1, ..., 3:6] = True  # left padded
    assert valid_prefix(mask) == 6
    full_k, full_v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    expected = F.scaled_dot_product_attention(q, full_k, full_v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(cache_attention(q, k, v, mask, 0.3), expected, rtol=0, atol=1e-6)
    per_head = mask.expand(batch, heads, 1, slots).clone()
    per_head[:, 1, :, 0] = False
    torch.testing.assert_close(
        cache_attention(q, k, v, per_head, None), F.scaled_dot_product_attention(q, full_k, full_v, attn_mask=per_head), rtol=0, atol=1e-6
    )
    k[:, :, 6:], v[:, :, 6:] = float("nan"), float("nan")
    assert torch.isfinite(CACHE_ATTENTION(q, k, v, mask, 0.3)).all()
    assert torch.isnan(F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.3)).any()
