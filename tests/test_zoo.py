"""The model zoo: every model builds, trains a step, is deterministic from its seed, and is
capturable by torch.compile; the attention variants and masks mean what they claim."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dscompile.zoo import HF_MODELS, ZOO, build, make_batch, targets

OWN_MODELS = [n for n in ZOO if n not in HF_MODELS]
CAUSAL_LMS = ["gpt", "gpt_explicit", "llama"]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", OWN_MODELS)
def test_forward_backward_finite(name: str) -> None:
    case = build(name)
    loss = case.model(*case.batch())
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = _grads(case.model)
    assert len(grads) == len(list(case.model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for g in grads.values())
    logits = case.model(*case.example_inputs)
    assert logits.shape[0] == case.targets.shape[0] and torch.isfinite(logits).all()


def test_build_does_not_import_transformers() -> None:
    code = "import sys, dscompile.zoo as z; z.build('gpt'); assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_sdpa_and_explicit_attention_agree() -> None:
    a, b = build("gpt", seed=3), build("gpt_explicit", seed=3)
    assert a.model.config.attention == "sdpa" and b.model.config.attention == "explicit"
    torch.testing.assert_close(a.model(*a.example_inputs), b.model(*b.example_inputs), atol=1e-5, rtol=1e-5)
    a.model(*a.batch()).backward()
    b.model(*b.batch()).backward()
    ga, gb = _grads(a.model), _grads(b.model)
    assert ga.keys() == gb.keys()
    for key in ga:
        torch.testing.assert_close(ga[key], gb[key], atol=1e-5, rtol=1e-4, msg=key)


def test_dropout_is_active_in_train_and_off_in_eval() -> None:
    case = build("gpt_explicit", dropout=0.2)
    x = case.example_inputs
    torch.manual_seed(0)
    first = case.model(*x)
    second = case.model(*x)
    assert not torch.allclose(first, second)
    case.model.eval()
    ref = build("gpt", dropout=0.2).model.eval()
    torch.testing.assert_close(case.model(*x), ref(*x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_causal_lms_do_not_look_ahead(name: str) -> None:
    case = build(name)
    (idx,) = case.example_inputs
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % case.model.config.vocab_size
    before, after = case.model(idx), case.model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], atol=0, rtol=0)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize("head", ["cls", "mlm"])
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_bert_padding_mask_hides_padded_tokens(head: str, norm: str) -> None:
    case = build("bert", head=head, norm=norm, batch_size=3)
    ids, mask = case.example_inputs
    assert mask[0].all() and not mask.all(), "the example batch must contain padding"
    row = int((~mask).any(dim=1).nonzero()[0])
    col = int((~mask[row]).nonzero()[0])
    changed = ids.clone()
    changed[row, col] = 7
    before, after = case.model(ids, mask), case.model(changed, mask)
    if head == "mlm":
        torch.testing.assert_close(before[mask], after[mask], atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(before, after, atol=1e-6, rtol=1e-6)
    # The same edit without the mask does change the outputs, so the check above can fail.
    full = torch.ones_like(mask)
    assert not torch.allclose(case.model(ids, full)[row], case.model(changed, full)[row])
    if head == "mlm":
        assert (case.targets[~mask] == -100).all()
        assert torch.isfinite(case.model(*case.batch()))


def test_llama_grouped_query_attention() -> None:
    case = build("llama", n_heads=4, n_kv_heads=2)
    assert case.model.blocks[0].attn.wk.out_features == 2 * 8
    loss = case.model(*case.batch())
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name", OWN_MODELS)
def test_construction_is_deterministic_from_seed(name: str) -> None:
    torch.manual_seed(1234)
    expected_next = torch.rand(3)
    torch.manual_seed(1234)
    a, b, c = build(name, seed=5), build(name, seed=5), build(name, seed=6)
    torch.testing.assert_close(torch.rand(3), expected_next)  # global RNG untouched
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], atol=0, rtol=0, msg=key)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())
    for x, y in zip(a.batch(), b.batch(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", OWN_MODELS)
def test_make_batch_shapes_and_seeds(name: str) -> None:
    case = build(name)
    ref = case.batch()
    same = make_batch(case, case.seed)
    other = make_batch(case, case.seed + 1)
    assert all(torch.equal(x, y) for x, y in zip(ref, same, strict=True))
    assert [t.shape for t in other] == [t.shape for t in ref]
    assert [t.dtype for t in other] == [t.dtype for t in ref]
    assert any(not torch.equal(x, y) for x, y in zip(ref, other, strict=True))
    assert torch.isfinite(case.model(*other))


@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
def test_seq_len_override(name: str) -> None:
    case = build(name, seq_len=8, batch_size=3)
    assert case.example_inputs[0].shape == (3, 8)
    assert torch.isfinite(case.model(*case.batch()))


def test_bad_names_and_options_are_explained() -> None:
    with pytest.raises(ValueError, match="unknown zoo model 'gtp'.*did you mean 'gpt'"):
        build("gtp")
    with pytest.raises(ValueError, match="zoo model 'mlp' has no option 'seq_len'"):
        build("mlp", seq_len=8)
    with pytest.raises(ValueError, match="attention must be one of"):
        build("gpt", attention="flash")
    with pytest.raises(ValueError, match="divisible by n_heads"):
        build("llama", d_model=30)


@pytest.mark.parametrize("name", ["gpt", "gpt_explicit", "llama", "bert", "mlp", "cnn"])
def test_cli_targets(name: str) -> None:
    model, inputs = getattr(targets, name)()
    out = model(*inputs)
    assert isinstance(inputs, tuple) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_models_build_and_train(name: str) -> None:
    pytest.importorskip("transformers")
    a, b = build(name, seed=2), build(name, seed=2)
    loss = a.model(*a.batch())
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(g).all() for g in _grads(a.model).values())
    logits = a.model(*a.example_inputs)
    assert logits.shape == (2, 16, 256)
    torch.testing.assert_close(b.model(*b.example_inputs), logits.detach(), atol=0, rtol=0)
    (idx,) = a.example_inputs
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    torch.testing.assert_close(a.model(changed)[:, :10], logits[:, :10], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", OWN_MODELS + [pytest.param(n, marks=pytest.mark.slow) for n in HF_MODELS])
def test_capturable_by_torch_compile(name: str) -> None:
    import copy

    if name in HF_MODELS:
        pytest.importorskip("transformers")
    torch._dynamo.reset()
    case = build(name)
    eager = case.model
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    ref_loss = eager(*case.batch())
    loss = compiled(*case.batch())
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    ref_loss.backward()
    loss.backward()
    ga, gb = _grads(eager), _grads(compiled_model)
    assert ga.keys() == gb.keys()
    for key in ga:
        torch.testing.assert_close(gb[key], ga[key], atol=1e-5, rtol=1e-4, msg=key)
    for key, buf in eager.named_buffers():  # batch-norm running stats were updated identically
        torch.testing.assert_close(dict(compiled_model.named_buffers())[key], buf, msg=key)
