"""The Triton kernels of the rotary and cache-attention ops (``kernels/_rotary_triton.py``,
``kernels/_cache_attention_triton.py``) against their torch paths, and the dispatch between them.

The kernels run under TRITON_INTERPRET=1 (set here before triton is imported) with tiny shapes.
Cache attention: fp32 within 1e-5 of the torch path, fp16/bf16 inputs within 3e-3/2e-2 of it in
fp32 (the kernel rounds the softmax weights to the input dtype before the value product, as
FlashAttention does); never a read of an unattended slot (NaN there, finite output). Rotary: the
torch path's bits in fp32 and fp16; bf16 within one bf16 rounding step, because the interpreter
truncates fp32 -> bf16 conversions where a GPU rounds to nearest.
"""

from __future__ import annotations

import os
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules
if not _TRITON_PREIMPORTED:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import dscompile  # noqa: E402
import dscompile.kernels.cache_attention as cache_attention_module  # noqa: E402
import dscompile.kernels.rotary as rotary_module  # noqa: E402
from dscompile.kernels.cache_attention import cache_attention, cache_attention_torch, cache_attention_triton  # noqa: E402
from dscompile.kernels.rotary import rotary, rotary_embedding, rotary_embedding_triton  # noqa: E402
from dscompile.kernels.triton_dispatch import resolve_impl, triton_importable  # noqa: E402
from dscompile.passes import inference_rotary  # noqa: E402
from dscompile.runtime.inference.ops import CACHE_ATTENTION, ROTARY_EMBEDDING  # noqa: E402

needs_interpreter = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton was imported before TRITON_INTERPRET=1 could be set; run this module on its own",
)
interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- cache attention


def _decode_mask(batch: int, heads: int, queries: int, slots: int, lengths: list[int], starts: list[int]) -> torch.Tensor:
    """Row ``b`` holds tokens ``starts[b]..lengths[b]-1`` (left padding before); its ``queries`` last ones attend causally."""
    mask = torch.zeros(batch, heads, queries, slots, dtype=torch.bool)
    for b in range(batch):
        for i in range(queries):
            mask[b, :, i, starts[b] : lengths[b] - queries + 1 + i] = True
    return mask


CASES = [
    # batch, heads, kv_heads, queries, slots, dim, dtype, splits
    pytest.param(2, 4, 2, 1, 37, 8, torch.float32, 1, id="gqa-decode-fp32"),
    pytest.param(2, 2, 2, 1, 37, 16, torch.float32, 3, id="mha-decode-fp32-3splits"),
    pytest.param(2, 6, 2, 4, 45, 8, torch.float32, 2, id="gqa-4queries-fp32-2splits"),
    pytest.param(1, 4, 1, 19, 19, 24, torch.float32, 1, id="mqa-prefill-fp32"),
    pytest.param(2, 4, 2, 3, 37, 16, torch.float16, 2, id="gqa-3queries-fp16"),
    pytest.param(2, 4, 2, 1, 37, 16, torch.bfloat16, 1, id="gqa-decode-bf16"),
]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@needs_interpreter
@pytest.mark.parametrize("batch,heads,kv_heads,queries,slots,dim,dtype,splits", CASES)
def test_cache_attention_triton_matches_torch(
    batch: int, heads: int, kv_heads: int, queries: int, slots: int, dim: int, dtype: torch.dtype, splits: int
) -> None:
    """Odd cache and prefix lengths (not multiples of the 16-column block), left padding, NaN in every unattended slot."""
    g = torch.Generator().manual_seed(slots + queries)
    q = torch.randn(batch, heads, queries, dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, slots, dim, generator=g).to(dtype) for _ in range(2))
    lengths, starts = [slots - 6, slots - 13][:batch], [0, 5][:batch]
    if queries == slots:  # a prefill: the whole cache, causal
        lengths = [slots]
    mask = _decode_mask(batch, 1, queries, slots, lengths, starts)
    expected = cache_attention_torch(q.float(), k.float(), v.float(), mask, 0.3)
    attended = mask.any(dim=(1, 2))  # [batch, slots]
    k[~attended[:, None, :, None].expand_as(k)] = float("nan")
    v[~attended[:, None, :, None].expand_as(v)] = float("nan")
    got = cache_attention_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), mask.to(DEVICE), 0.3, splits=splits).cpu()
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected, rtol=TOL[dtype], atol=TOL[dtype])


@needs_interpreter
def test_cache_attention_triton_mask_per_head_and_empty_rows() -> None:
    """A mask per query head (GQA: heads sharing a KV head see different columns), one row attending nothing
    (0, as SDPA gives), the default scale; the splits' merge equals one pass."""
    g = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, queries, slots, dim = 2, 4, 2, 2, 29, 8
    q = torch.randn(batch, heads, queries, dim, generator=g)
    k, v = torch.randn(batch, kv_heads, slots, dim, generator=g), torch.randn(batch, kv_heads, slots, dim, generator=g)
    mask = _decode_mask(batch, heads, queries, slots, [21, 17], [0, 3])
    mask[:, 1, :, :4] = False
    mask[0, 2, 1, :] = False
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    assert torch.equal(expected[0, 2, 1], torch.zeros(dim))
    for splits in (1, 4):
        got = cache_attention_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), mask.to(DEVICE), splits=splits).cpu()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_cache_attention_triton_propagates_nan_in_attended_slots() -> None:
    """Garbage in an attended slot is not hidden: NaN there gives NaN, as SDPA does."""
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 20, 8), torch.randn(1, 1, 20, 8)
    mask = torch.zeros(1, 1, 1, 20, dtype=torch.bool)
    mask[..., :9] = True
    k[0, 0, 4] = float("nan")
    assert torch.isnan(cache_attention_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), mask.to(DEVICE))).all()


@needs_interpreter
def test_cache_attention_triton_reads_no_value_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton path takes its bounds from the mask on the device: no ``item``/``bool``/``int`` of a tensor (each a
    device sync on CUDA, which CUDA-graph capture forbids). The torch path does read one (the valid prefix)."""
    q, k = torch.randn(1, 2, 1, 8, device=DEVICE), torch.randn(1, 1, 20, 8, device=DEVICE)
    mask = torch.zeros(1, 1, 1, 20, dtype=torch.bool, device=DEVICE)
    mask[..., :7] = True
    expected = cache_attention_torch(q, k, k, mask)

    def host_read(*args: object) -> None:
        raise AssertionError("a tensor value read on the host")

    with monkeypatch.context() as patch:
        for name in ("item", "__bool__", "__int__", "__float__", "tolist"):
            patch.setattr(torch.Tensor, name, host_read)
        got = [cache_attention_triton(q, k, k, mask, splits=splits) for splits in (1, 2)]
        with pytest.raises(AssertionError, match="host"):
            cache_attention_torch(q, k, k, mask)
    for out in got:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- rotary


def _tables(lead: tuple[int, ...], d: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.randn(*lead, d // 2, generator=g).repeat_interleave(1, -1).repeat(*(1,) * len(lead), 2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [None, 8, 6])
def test_rotary_triton_matches_torch(dtype: torch.dtype, rotary_dim: int | None) -> None:
    """[batch, heads, seq, 18] (odd sequence; partial rotary with an odd half), cos/sin broadcast over heads."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 18, generator=g).to(dtype)
    d = rotary_dim or 18
    cos, sin = _tables((2, 1, 5), d, dtype, g)
    expected = rotary_embedding(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), rotary_dim).cpu()
    got = rotary_embedding_triton(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), rotary_dim).cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        # the interpreter truncates fp32 -> bf16: the same bits as torch's formula rounded that way after each op
        torch.testing.assert_close(got, expected, rtol=2**-5, atol=2**-5)
        assert torch.equal(got, _rotary_truncating_bf16(x, cos, sin, d))
    else:
        assert torch.equal(got, expected)


def _rotary_truncating_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d: int) -> torch.Tensor:
    """``rotary_embedding``'s formula in fp32, each product and sum cut to bf16 by truncation (the interpreter's conversion)."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        return (t.float().view(torch.int32) & -65536).view(torch.float32)

    h = d // 2
    x1, x2, c1, c2, s1, s2 = (t.float() for t in (x[..., :h], x[..., h:d], cos[..., :h], cos[..., h:], sin[..., :h], sin[..., h:]))
    first = cut(cut(x1 * c1) - cut(x2 * s1))
    second = cut(cut(x2 * c2) + cut(x1 * s2))
    return torch.cat([first, second, x[..., d:].float()], dim=-1).to(torch.bfloat16)


@needs_interpreter
def test_rotary_triton_strided_inputs() -> None:
    """A transposed (non-contiguous) ``x`` of 3 dims, 1-D tables, and one of 5 dims with a table broadcast over two."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, 12, generator=g).to(DEVICE).transpose(0, 1)
    cos, sin = torch.randn(12, generator=g).to(DEVICE), torch.randn(12, generator=g).to(DEVICE)
    assert torch.equal(rotary_embedding_triton(x, cos, sin), rotary_embedding(x, cos, sin))
    x5 = torch.randn(2, 3, 2, 3, 8, generator=g).to(DEVICE)
    cos5, sin5 = torch.randn(2, 1, 2, 1, 8, generator=g).to(DEVICE), torch.randn(2, 1, 2, 1, 8, generator=g).to(DEVICE)
    assert torch.equal(rotary_embedding_triton(x5, cos5, sin5), rotary_embedding(x5, cos5, sin5))


# ----------------------------------------------------------------------------- dispatch


def test_dispatch_chooses_triton_on_cuda() -> None:
    """``auto``: Triton for CUDA tensors when triton imports, torch elsewhere; the rotary pass emits the op on CUDA."""
    assert triton_importable()
    assert resolve_impl("auto", torch.device("cuda", 0)) == "triton"
    assert resolve_impl("auto", torch.device("cpu")) == "torch"
    assert resolve_impl("torch", torch.device("cuda")) == "torch" and resolve_impl("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="not one of"):
        resolve_impl("cuda", torch.device("cpu"))
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["val"] = torch.empty(2, 4, device="meta")
    assert inference_rotary.fused_rotary(node) is rotary_embedding
    node.meta["val"] = torch.empty(2, 4, device="cuda") if torch.cuda.is_available() else _cuda_fake()
    assert inference_rotary.fused_rotary(node) is ROTARY_EMBEDDING


def _cuda_fake() -> torch.Tensor:
    """A fake tensor that says it is on CUDA (what the pass sees in a graph traced for a GPU), without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(2, 4, device="cuda")


def test_auto_runs_torch_path_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU tensors ``auto`` takes the torch path (no Triton launch) for both ops."""

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("Triton kernel launched on CPU under impl=auto")

    monkeypatch.setattr(cache_attention_module, "cache_attention_triton", boom)
    monkeypatch.setattr(rotary_module, "rotary_embedding_triton", boom)
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 5, 8)
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    torch.testing.assert_close(cache_attention(q, k, k, mask), cache_attention_torch(q, k, k, mask))
    x, c = torch.randn(2, 8), torch.randn(8)
    assert torch.equal(rotary(x, c, c), rotary_embedding(x, c, c))


# ----------------------------------------------------------------------------- in an engine


@interpreter_only
@pytest.mark.parametrize("arch,lower", [("llama", None), ("gpt_neox", "triton")])
def test_engine_with_triton_kernels_matches_hf(monkeypatch: pytest.MonkeyPatch, arch: str, lower: str | None) -> None:
    """The Triton kernels forced in place of the torch paths (as on CUDA) inside a kernel-injected engine: both
    custom ops in the prefill and decode graphs, HF's greedy tokens, logits within 1e-5, one decode compile. Llama
    (GQA) under Inductor (the default), GPT-NeoX (partial rotary) under dscompile's Triton lowering."""
    pytest.importorskip("transformers")
    from test_inference import left_padded_batch, tiny

    launches = {"rotary": 0, "attention": 0}

    def counted(name: str, fn: object) -> object:
        def wrapper(*args: object, **kwargs: object) -> object:
            launches[name] += 1
            return fn(*args, **kwargs)  # type: ignore[operator]

        return wrapper

    monkeypatch.setattr(inference_rotary, "resolve_impl", lambda impl, device: "triton")
    monkeypatch.setattr(rotary_module, "resolve_impl", lambda impl, device: "triton")
    monkeypatch.setattr(cache_attention_module, "resolve_impl", lambda impl, device: "triton")
    monkeypatch.setattr(rotary_module, "rotary_embedding_triton", counted("rotary", rotary_embedding_triton))
    monkeypatch.setattr(cache_attention_module, "cache_attention_triton", counted("attention", cache_attention_triton))
    model = tiny(arch)
    ids, mask = left_padded_batch()
    new = 4
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=40, lower=lower, replace_with_kernel_inject=True)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=new, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(ref.logits, 1), rtol=0, atol=1e-5)
    assert engine.compile_counts["decode"] == 1, engine.compile_counts
    # 2 layers, `new` forward calls (prefill + new - 1 decode steps): 2 rotary calls (Q, K) and 1 attention per layer
    assert launches == {"rotary": 4 * new, "attention": 2 * new}, launches
    assert CACHE_ATTENTION is torch.ops.dscompile.cache_attention.default


# ----------------------------------------------------------------------------- on a GPU (bench/gpu_check.py runs these)


@pytest.mark.gpu
def test_decode_step_with_both_ops_captures_in_a_cuda_graph() -> None:
    """Cache write at a device-side position, rotary and cache attention (``auto``: the Triton kernels, default
    splits) captured once with ``torch.cuda.graph`` and replayed at later positions: the eager results, bf16."""
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, slots, dim = 2, 8, 2, 300, 64
    q = torch.randn(batch, heads, 1, dim, generator=gen).cuda().bfloat16()
    k_cache, v_cache = (torch.randn(batch, kv_heads, slots, dim, generator=gen).cuda().bfloat16() for _ in range(2))
    mask = torch.zeros(batch, 1, 1, slots, dtype=torch.bool, device="cuda")
    mask[..., :70] = True
    new_k, new_v = (torch.randn(batch, kv_heads, 1, dim, generator=gen).cuda().bfloat16() for _ in range(2))
    angles = torch.randn(batch, 1, 1, dim // 2, generator=gen).repeat(1, 1, 1, 2).cuda()
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    pos = torch.tensor([70], device="cuda")

    def step() -> torch.Tensor:
        k_cache.index_copy_(2, pos, ROTARY_EMBEDDING(new_k, cos, sin, None))
        v_cache.index_copy_(2, pos, new_v)
        mask.index_fill_(3, pos, True)
        return CACHE_ATTENTION(ROTARY_EMBEDDING(q, cos, sin, None), k_cache, v_cache, mask, None)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for p in range(71, 75):
        pos.fill_(p)
        graph.replay()
        got = out.clone()
        expected = cache_attention_torch(rotary_embedding(q, cos, sin), k_cache, v_cache, mask)
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
        assert bool(mask[0, 0, 0, p]) and not bool(mask[0, 0, 0, p + 1])
