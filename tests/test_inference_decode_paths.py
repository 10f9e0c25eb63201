"""What makes ``init_inference`` generation fast on CPU, checked structurally (not by timing).

- ``decode_gemv``: under Inductor the decode graph's few-row matmuls are weight-streaming reductions
  (every linear and the LM head), the prefill's many-row ones stay ``mm``, and the tokens still equal
  Hugging Face's exactly (logits within 1e-5); the int8 engine's decode matmuls read the packed codes
  through the same rewrite; other lowerings leave the graph alone.
- The prefill runs the LM head on the last prompt position only (``logits_to_keep``).
"""

from __future__ import annotations

import pytest
import torch

import dscompile
from dscompile.passes.inference_gemv import DecodeGemvOptions, decode_gemv
from dscompile.pipeline import PassContext

pytest.importorskip("transformers")

from test_inference import NEW, VOCAB, left_padded_batch, pass_messages, tiny  # noqa: E402

aten = torch.ops.aten


def _rewrites(messages: list[str]) -> list[int]:
    return [int(m.split(": ")[1].split()[0]) for m in messages if "weight-streaming" in m]


def test_decode_matmuls_stream_weights_and_match_hf() -> None:
    """2 layers x 7 linears + the LM head in the decode graph; the 7-token prefill keeps mm but for its 1-row LM head."""
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=64)
    with pass_messages("decode_gemv") as messages:
        out = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True)
    assert _rewrites(messages) == [1, 15], messages  # prefill: the LM head's single row; decode: all 15
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(ref.logits, 1), rtol=0, atol=1e-5)
    assert engine.compile_counts["decode"] == 1


def test_int8_decode_reads_packed_codes() -> None:
    """The int8 decode graph's matmuls take the dequantized weight as a producer of the reduction, not an mm input.

    ``quantize_embeddings``: the LM head packed too (by default it stays fp32), so all 15 matmuls read codes."""
    quant = {"enabled": True, "weight": {"num_bits": 8, "q_groups": 4, "quantize_embeddings": True}}
    engine = dscompile.init_inference(tiny("llama"), dtype=torch.float32, max_out_tokens=64, quant=quant)
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    with pass_messages("decode_gemv") as messages:
        out = engine.generate(ids, max_new_tokens=6)
    assert out.shape == (1, 11)
    assert _rewrites(messages) == [15, 15], messages  # 5 prompt rows are within max_rows_packed too


def _linear_graph(rows: int) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.addmm(b, x, w.t())

    args = [torch.randn(rows, 16), torch.randn(8, 16), torch.randn(8)]
    with FakeTensorMode(allow_non_fake_inputs=True):
        gm = make_fx(f, tracing_mode="fake")(*args)
    return gm, args


def test_pass_rewrites_few_rows_only_under_inductor() -> None:
    for lowering, rows, rewritten in (("inductor", 1, True), ("inductor", 3, False), ("eager", 1, False)):
        gm, args = _linear_graph(rows)
        ctx = PassContext(config=None, graph_kind="forward", graph_name="g", is_inference=True, analysis={"lowering": lowering})
        expected = gm(*args)
        gm = decode_gemv(gm, ctx, DecodeGemvOptions())
        targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        assert (aten.addmm.default not in targets) == rewritten, (lowering, rows, targets)
        torch.testing.assert_close(gm(*args), expected, rtol=1e-6, atol=1e-6)


def test_prefill_computes_last_position_logits_only() -> None:
    engine = dscompile.init_inference(tiny("llama"), dtype=torch.float32, max_out_tokens=64, lower="eager")
    generator = engine._static_generator()
    prefill, shapes = generator.prefill, []

    def spy(**kwargs: object) -> torch.Tensor:
        logits = prefill(**kwargs)
        shapes.append(tuple(logits.shape))
        return logits

    generator.prefill = spy
    ids, mask = left_padded_batch()
    engine.generate(ids, attention_mask=mask, max_new_tokens=3)
    assert shapes == [(2, 1, VOCAB)], shapes


def test_later_decode_steps_skip_guard_evaluation() -> None:
    """Every call's first decode step runs Dynamo's guards in full; the steps after it only the differentiating ones."""
    from torch._dynamo import eval_frame

    engine = dscompile.init_inference(tiny("llama"), dtype=torch.float32, max_out_tokens=64, lower="eager")
    generator = engine._static_generator()
    decode, skipped = generator.decode, []

    def spy(**kwargs: object) -> torch.Tensor:
        skipped.append(eval_frame._stance.skip_guard_eval_unsafe)
        return decode(**kwargs)

    generator.decode = spy
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        engine.generate(ids, max_new_tokens=4)
    assert skipped == [False, True, True] * 2, skipped
    assert engine.compile_counts["decode"] == 1
