"""The sparse_attention pass finds attention in Dynamo graphs and swaps in the block-sparse op.

Compiled models are compared with eager models whose attention gets the layout as a mask.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dscompile.sparsity import layout_to_mask, parse_sparse_attention

SEQ, DIM, HEADS, BLOCK = 64, 32, 2, 16
BIGBIRD = {"mode": "bigbird", "block": BLOCK, "num_random_blocks": 1, "num_sliding_window_blocks": 1,
           "different_layout_per_head": True}  # fmt: skip


class TinyAttention(nn.Module):
    """One attention layer written in a chosen spelling; ``layout_mask`` (eager only) adds the layout."""

    def __init__(self, variant: str, p: float = 0.0) -> None:
        super().__init__()
        self.variant, self.p = variant, p
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.register_buffer("causal", torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), persistent=False)
        self.layout_mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, HEADS, -1).transpose(1, 2) for y in self.qkv(x).split(DIM, -1))
        extra = self.layout_mask
        keep = pad[:, None, None, :]
        if extra is not None:
            keep = keep & extra[None]
        hd = q.shape[-1]
        if self.variant == "sdpa_causal":
            mask = extra[None] & self.causal[:t, :t] if extra is not None else None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        elif self.variant == "sdpa_bool":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        elif self.variant == "sdpa_additive":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(keep, 0.0, float("-inf")), scale=0.2)
        elif self.variant == "explicit_div":
            s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(hd)
            s = s.masked_fill(~keep, float("-inf"))
            y = torch.matmul(s.softmax(dim=-1), v)
        elif self.variant == "explicit_causal_pad":
            s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            s = s.masked_fill(~self.causal[:t, :t], float("-inf"))
            s = s + torch.where(keep, 0.0, torch.finfo(s.dtype).min)
            w = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            y = F.dropout(w, p=self.p, training=self.training) @ v
        else:
            raise ValueError(self.variant)
        return self.out(y.transpose(1, 2).reshape(b, t, DIM))


def _run(model: nn.Module, x: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    out = model(x, pad)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, SEQ, DIM, generator=gen)
    pad = torch.arange(SEQ)[None, :] < torch.tensor([SEQ, SEQ - 7])[:, None]
    return x, pad


def _compile(model: nn.Module, section: dict) -> nn.Module:
    torch._dynamo.reset()
    return torch.compile(model, backend="dscompile", options={"sparse_attention": section, "lower": "eager"})


@pytest.mark.parametrize("variant", ["sdpa_causal", "sdpa_bool", "sdpa_additive", "explicit_div", "explicit_causal_pad"])
def test_compiled_sparse_matches_masked_eager(variant: str) -> None:
    torch.manual_seed(0)
    model = TinyAttention(variant)
    ref = copy.deepcopy(model)
    layout = parse_sparse_attention(BIGBIRD).sparsity_config(HEADS).make_layout(SEQ)
    assert layout.float().mean() < 0.9  # the layout really is sparse
    ref.layout_mask = layout_to_mask(layout, BLOCK)
    x, pad = _data()
    out, grads = _run(_compile(model, BIGBIRD), x, pad)
    ref_out, ref_grads = _run(ref, x, pad)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # and the sparse answer differs from dense attention: the layout mattered
    dense = copy.deepcopy(ref)
    dense.layout_mask = None
    dense_out, _ = _run(dense, x, pad)
    assert not torch.allclose(out, dense_out, atol=1e-3)


def _capture(model: nn.Module, section: dict, x: torch.Tensor, pad: torch.Tensor) -> torch.fx.GraphModule:
    """Run the pass on the Dynamo graph directly and return the rewritten graph."""
    from dscompile.passes.sparse_attention import sparse_attention_pass
    from dscompile.pipeline import PassContext

    seen: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        ctx = PassContext(config=None, graph_kind="pre_autograd", graph_name="test", example_inputs=example_inputs)
        gm = sparse_attention_pass(gm, ctx, parse_sparse_attention(section))
        gm.recompile()
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x, pad)
    return seen[0]


def test_graph_holds_the_op_and_lints() -> None:
    from dscompile.graph import lint_graph

    x, pad = _data()
    gm = _capture(TinyAttention("explicit_causal_pad"), BIGBIRD, x, pad)
    code = gm.code
    assert "dscompile.block_sparse_attention" in code and "softmax" not in code
    lint_graph(gm, "sparse_attention")
    op = next(n for n in gm.graph.nodes if "block_sparse_attention" in str(n.target))
    assert op.meta["dscompile"]["sparse_attention"]["mode"] == "bigbird"


def test_training_dropout_goes_into_the_op() -> None:
    x, pad = _data()
    model = TinyAttention("explicit_causal_pad", p=0.25).train()
    gm = _capture(model, BIGBIRD, x, pad)
    op = next(n for n in gm.graph.nodes if "block_sparse_attention" in str(n.target))
    assert op.args[9] == 0.25 and op.args[5] is not None  # dropout_p and a seed node
    out, grads = _run(_compile(TinyAttention("explicit_causal_pad", p=0.25).train(), BIGBIRD), x, pad)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    evaluated = _capture(TinyAttention("explicit_causal_pad", p=0.25).eval(), BIGBIRD, x, pad)
    op = next(n for n in evaluated.graph.nodes if "block_sparse_attention" in str(n.target))
    assert op.args[9] == 0.0  # eval mode: no dropout


class WeightsReturned(nn.Module):
    """Attention whose weights are also returned: the pass must leave it alone."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return w @ v, w


def test_unmatched_attention_is_left_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    q, k, v = (torch.randn(1, 2, SEQ, 16) for _ in range(3))
    from dscompile.passes.sparse_attention import sparse_attention_pass
    from dscompile.pipeline import PassContext

    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        ctx = PassContext(config=None, graph_kind="pre_autograd", graph_name="t", example_inputs=example_inputs)
        graphs.append(sparse_attention_pass(gm, ctx, parse_sparse_attention(BIGBIRD)))
        return gm.forward

    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="dscompile.passes.sparse_attention"):
        out, w = torch.compile(WeightsReturned(), backend=backend)(q, k, v)
    assert "block_sparse_attention" not in graphs[0].code
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "stays dense" in warning.message and "users" in warning.message  # why
    assert "test_sparse_attention_pass.py" in warning.message  # and where: the site's source line
    ref_out, ref_w = WeightsReturned()(q, k, v)
    assert torch.equal(out, ref_out) and torch.equal(w, ref_w)


def _root_cause(error: BaseException, kind: type) -> BaseException | None:
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, kind):
        cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
    return cause


def test_strict_makes_a_dense_site_an_error() -> None:
    from dscompile.passes.sparse_attention import SparseAttentionLeftDenseError

    q, k, v = (torch.randn(1, 2, SEQ, 16) for _ in range(3))
    torch._dynamo.reset()
    compiled = torch.compile(WeightsReturned(), backend="dscompile", options={"sparse_attention": {**BIGBIRD, "strict": True}})
    with pytest.raises(Exception) as info:
        compiled(q, k, v)
    cause = _root_cause(info.value, SparseAttentionLeftDenseError)
    assert cause is not None, info.value
    assert "stays dense" in str(cause) and "strict" in str(cause)


class Classifier(nn.Module):
    """A softmax that is not attention (class probabilities) beside one that is: only attention counts."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = TinyAttention("sdpa_bool")
        self.head = nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.head(self.attn(x, pad)), dim=-1)


def test_a_softmax_outside_attention_is_not_a_site(caplog: pytest.LogCaptureFixture) -> None:
    x, pad = _data()
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="dscompile.passes.sparse_attention"):
        out = torch.compile(Classifier(), backend="dscompile", options={"sparse_attention": {**BIGBIRD, "strict": True}})(x, pad)
    assert torch.isfinite(out).all()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "replaced 1 attention site" in caplog.text


@pytest.mark.parametrize("variant", ["sdpa_tril", "fill_not_tril", "explicit_causal_pad"])
def test_lengths_that_change_stay_sparse(variant: str, caplog: pytest.LogCaptureFixture) -> None:
    """Dynamo makes the sequence length symbolic at the second distinct length; the op then builds each
    length's layout when it runs. Three lengths (one not a multiple of the block), one dynamic graph,
    every step equal to eager attention under that length's layout, outputs and gradients, under the
    default lowering. Dense attention differs: the layout is applied."""
    torch.manual_seed(0)
    model = (BuiltMask if variant in CAUSAL_VARIANTS else TinyAttention)(variant)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dscompile", options={"sparse_attention": {**BIGBIRD, "strict": True}})
    config = parse_sparse_attention(BIGBIRD).sparsity_config(HEADS)
    with caplog.at_level(logging.INFO, logger="dscompile.passes.sparse_attention"):
        for seq in (SEQ, 48, 40):
            gen = torch.Generator().manual_seed(seq)
            x = torch.randn(2, seq, DIM, generator=gen)
            pad = torch.arange(seq)[None, :] < torch.tensor([seq, seq - 5])[:, None]
            model.zero_grad()
            out = compiled(x, pad)
            out.square().sum().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            ref = copy.deepcopy(model)
            ref.zero_grad()
            ref.layout_mask = layout_to_mask(config.make_layout(seq), BLOCK, seq)
            ref_out = ref(x, pad)
            ref_out.square().sum().backward()
            torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
            for a, b in zip(grads, ref.parameters(), strict=True):
                torch.testing.assert_close(a, b.grad, atol=1e-4, rtol=1e-4)
            ref.layout_mask = None
            assert not torch.allclose(out, ref(x, pad), atol=1e-3), f"length {seq}: the output is dense attention's"
    assert caplog.text.count("replaced 1 attention site") == 2  # the first length, then one dynamic graph for the rest


ZOO = ["gpt", "gpt_explicit", "llama", "bert"]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_dense_mode_is_exactly_eager(name: str) -> None:
    from dscompile.zoo import build

    case = build(name, seq_len=32)
    ref = copy.deepcopy(case.model)
    batch = case.batch()
    torch._dynamo.reset()
    compiled = torch.compile(case.model, backend="dscompile", options={"sparse_attention": {"mode": "dense"}, "lower": "eager"})
    loss = compiled(*batch)
    loss.backward()
    ref_loss = ref(*batch)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for a, b in zip(case.model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_rewritten_with_full_layout_matches_eager(name: str) -> None:
    """A fixed layout whose local window spans the sequence is dense: the rewritten model must match eager."""
    from dscompile.zoo import build

    case = build(name, seq_len=32)
    ref = copy.deepcopy(case.model)
    batch = case.batch()
    section = {"mode": "fixed", "block": 16, "num_local_blocks": 2}
    torch._dynamo.reset()
    compiled = torch.compile(case.model, backend="dscompile", options={"sparse_attention": section, "lower": "eager"})
    loss = compiled(*batch)
    loss.backward()
    ref_loss = ref(*batch)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for a, b in zip(case.model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)


def test_textual_pipeline_and_dump(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = TinyAttention("sdpa_causal")
    x, pad = _data()
    torch._dynamo.reset()
    pipeline = "sparse_attention(mode=bslongformer,block=16,num_sliding_window_blocks=3),lower(eager)"
    out = torch.compile(model, backend="dscompile", options={"pipeline": pipeline, "dump": str(tmp_path)})(x, pad)
    assert torch.isfinite(out).all()
    dumped = "\n".join(p.read_text(errors="ignore") for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".py", ".txt"))
    assert "block_sparse_attention" in dumped


class BuiltMask(nn.Module):
    """Attention whose mask the forward builds itself (so the graph shows how), in a chosen spelling."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.layout_mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, HEADS, -1).transpose(1, 2) for y in self.qkv(x).split(DIM, -1))
        ones = torch.ones(t, t, dtype=torch.bool, device=x.device)
        extra = self.layout_mask[None] if self.layout_mask is not None else None
        if self.variant == "sdpa_tril":
            keep = ones.tril()[None, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep if extra is None else keep & extra)
        elif self.variant == "sdpa_where_tril":
            keep = torch.tril(ones)
            bias = torch.where(keep if extra is None else keep & extra, 0.0, float("-inf"))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        elif self.variant in ("fill_not_tril", "fill_triu", "fill_tril_shifted"):
            if self.variant == "fill_not_tril":
                drop = ~ones.tril()
            elif self.variant == "fill_triu":
                drop = torch.triu(ones, diagonal=1)
            else:
                drop = ~ones.tril(diagonal=1)  # lets each query see one future key: not causal
            if extra is not None:
                drop = drop | ~extra
            s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
            y = torch.softmax(s.masked_fill(drop, float("-inf")), dim=-1) @ v
        else:
            raise ValueError(self.variant)
        return y.transpose(1, 2).reshape(b, t, DIM)


CAUSAL_VARIANTS = ["sdpa_tril", "sdpa_where_tril", "fill_not_tril", "fill_triu"]


def _op_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if "block_sparse_attention" in str(n.target))


@pytest.mark.parametrize("variant", [*CAUSAL_VARIANTS, "fill_tril_shifted"])
def test_causal_masks_built_in_the_graph_become_the_causal_flag(variant: str) -> None:
    x, pad = _data()
    gm = _capture(BuiltMask(variant), BIGBIRD, x, pad)
    op = _op_node(gm)
    bias, causal = op.args[4], op.args[8]
    if variant in CAUSAL_VARIANTS:
        assert causal is True and bias is None  # blocks above the diagonal are skipped, no bias is read
        assert op.meta["dscompile"]["sparse_attention"]["causal"] is True
    else:
        assert causal is False and bias is not None  # not the causal triangle: kept as a bias


def test_mask_from_a_buffer_stays_a_bias() -> None:
    """A buffer's contents are not in the graph (and may change), so it cannot be folded into causal=True."""
    x, pad = _data()
    gm = _capture(TinyAttention("explicit_causal_pad"), BIGBIRD, x, pad)
    op = _op_node(gm)
    assert op.args[8] is False and op.args[4] is not None


@pytest.mark.parametrize("variant", [*CAUSAL_VARIANTS, "fill_tril_shifted"])
def test_folded_causal_matches_masked_eager(variant: str) -> None:
    torch.manual_seed(0)
    model = BuiltMask(variant)
    ref = copy.deepcopy(model)
    ref.layout_mask = layout_to_mask(parse_sparse_attention(BIGBIRD).sparsity_config(HEADS).make_layout(SEQ), BLOCK)
    x, _ = _data()
    compiled = _compile(model, BIGBIRD)
    out = compiled(x)
    out.square().sum().backward()
    ref_out = ref(x)
    ref_out.square().sum().backward()
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)
