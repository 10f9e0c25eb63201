"""The sparsity layouts follow their published rules; the config section parses like DeepSpeed's."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from dscompile.errors import DSCompileConfigError
from dscompile.sparsity import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseAttentionConfig,
    SparsityConfig,
    VariableSparsityConfig,
    layout_to_mask,
    parse_sparse_attention,
)


def test_base_and_dense() -> None:
    lay = DenseSparsityConfig(num_heads=3, block=16).make_layout(128)
    assert lay.shape == (3, 8, 8) and lay.dtype == torch.int64 and bool((lay == 1).all())
    with pytest.raises(NotImplementedError):
        SparsityConfig(2).make_layout(32)


@pytest.mark.parametrize("attention", ["bidirectional", "unidirectional"])
def test_fixed_local_windows_and_global_columns(attention: str) -> None:
    L, G, nb = 4, 1, 12
    lay = FixedSparsityConfig(2, 16, num_local_blocks=L, num_global_blocks=G, attention=attention).make_layout(nb * 16)[0]
    for i in range(nb):
        for j in range(nb):
            same_window = i // L == j // L and (attention == "bidirectional" or j <= i)
            global_col = j % L == L - 1 and (attention == "bidirectional" or i >= j)
            assert lay[i, j] == int(same_window or global_col), (i, j)
    if attention == "unidirectional":
        assert bool((lay.triu(1) == 0).all())


def test_fixed_horizontal_global_and_symmetry() -> None:
    lay = FixedSparsityConfig(1, 16, num_local_blocks=4, num_global_blocks=2, horizontal_global_attention=True).make_layout(256)[0]
    for g in (2, 3, 6, 7, 10, 11, 14, 15):  # the last two blocks of each window of four
        assert bool((lay[g] == 1).all()) and bool((lay[:, g] == 1).all())
    assert torch.equal(lay, lay.T)


def test_fixed_partial_last_window_and_patterns() -> None:
    lay = FixedSparsityConfig(1, 16, num_local_blocks=4).make_layout(6 * 16)[0]
    # windows [0..3] and a partial one [4, 5]: its global block is the last block that fits
    assert bool((lay[:, 3] == 1).all()) and bool((lay[:, 5] == 1).all())
    per_head = FixedSparsityConfig(4, 16, True, num_local_blocks=4, num_global_blocks=1, num_different_global_patterns=4)
    lay = per_head.make_layout(128)
    for h in range(4):
        column = 4 - (1 + h) * 1
        assert bool((lay[h, :, column] == 1).all()) and bool((lay[h, :, column + 4] == 1).all())
    assert not torch.equal(lay[0], lay[1])


def test_fixed_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="divisible"):
        FixedSparsityConfig(2, num_local_blocks=4, num_global_blocks=3)
    with pytest.raises(ValueError, match="horizontal_global_attention"):
        FixedSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True)
    with pytest.raises(ValueError, match="different_layout_per_head"):
        FixedSparsityConfig(2, num_different_global_patterns=2)
    with pytest.raises(ValueError, match="attention"):
        FixedSparsityConfig(2, attention="sideways")


def test_variable_windows_globals_and_random_counts() -> None:
    cfg = VariableSparsityConfig(1, 16, local_window_blocks=[1, 2, 3], global_block_indices=[], num_random_blocks=0)
    lay = cfg.make_layout(12 * 16)[0]
    windows = [range(0, 1), range(1, 3), range(3, 6), range(6, 9), range(9, 12)]  # the last size repeats
    expected = torch.zeros(12, 12, dtype=torch.int64)
    for w in windows:
        expected[w.start : w.stop, w.start : w.stop] = 1
    assert torch.equal(lay, expected)
    ranged = VariableSparsityConfig(1, 16, local_window_blocks=[1], global_block_indices=[2, 7], global_block_end_indices=[4, 8],
                                    horizontal_global_attention=True).make_layout(160)[0]  # fmt: skip
    for g in (2, 3, 7):
        assert bool((ranged[:, g] == 1).all()) and bool((ranged[g] == 1).all())
    assert ranged[5, 6] == 0
    rnd = VariableSparsityConfig(1, 16, num_random_blocks=3, seed=1)
    zeros = torch.zeros(1, 10, 10, dtype=torch.int64)
    rnd.set_random_layout(0, zeros, random.Random(1))
    assert bool((zeros[0].sum(-1) == 3).all())
    uni = VariableSparsityConfig(1, 16, local_window_blocks=[2], global_block_indices=[1], attention="unidirectional").make_layout(128)[0]
    assert bool((uni.triu(1) == 0).all()) and bool((uni[1:, 1] == 1).all())


def test_variable_rejects_bad_ranges() -> None:
    with pytest.raises(ValueError, match="same length"):
        VariableSparsityConfig(1, global_block_indices=[0, 4], global_block_end_indices=[2])
    with pytest.raises(ValueError, match="empty"):
        VariableSparsityConfig(1, global_block_indices=[3], global_block_end_indices=[3])


@pytest.mark.parametrize("attention", ["bidirectional", "unidirectional"])
def test_bigbird_rules(attention: str) -> None:
    cfg = BigBirdSparsityConfig(2, 16, True, num_random_blocks=2, num_sliding_window_blocks=3, num_global_blocks=1,
                                attention=attention, seed=3)  # fmt: skip
    nb = 16
    lay = cfg.make_layout(nb * 16)
    for h in range(2):
        for i in range(nb):
            for j in range(max(0, i - 1), min(nb, i + 2)):  # window of 3 centred on the diagonal
                if attention == "bidirectional" or j <= i:
                    assert lay[h, i, j] == 1
        assert bool((lay[h, :, 0] == 1).all())
        if attention == "bidirectional":
            assert bool((lay[h, 0] == 1).all())
        else:
            assert bool((lay[h].triu(1) == 0).all())
    assert not torch.equal(lay[0], lay[1])  # per-head random blocks differ
    zeros = torch.zeros(1, nb, nb, dtype=torch.int64)
    cfg.set_random_layout(0, zeros, random.Random(0))
    counts = zeros[0].sum(-1)
    if attention == "bidirectional":
        assert bool((counts == 2).all())
    else:
        assert bool((counts == torch.arange(nb).add(1).clamp(max=2)).all())
        assert bool((zeros[0].triu(1) == 0).all())
    no_random = BigBirdSparsityConfig(1, 16, num_random_blocks=0, num_global_blocks=2).make_layout(256)[0]
    assert torch.equal(no_random, no_random.T)


def test_bigbird_is_seeded() -> None:
    make = lambda seed: BigBirdSparsityConfig(2, 16, True, num_random_blocks=2, seed=seed).make_layout(512)
    assert torch.equal(make(5), make(5))
    assert not torch.equal(make(5), make(6))


def test_bslongformer_rules() -> None:
    lay = BSLongformerSparsityConfig(1, 16, num_sliding_window_blocks=5, global_block_indices=[0, 9]).make_layout(16 * 12)[0]
    for i in range(12):
        for j in range(12):
            expected = abs(i - j) <= 2 or i in (0, 9) or j in (0, 9)
            assert lay[i, j] == int(expected)
    assert torch.equal(lay, lay.T)
    ranged = BSLongformerSparsityConfig(1, 16, num_sliding_window_blocks=1, global_block_indices=[3],
                                        global_block_end_indices=[5], attention="unidirectional").make_layout(128)[0]  # fmt: skip
    assert bool((ranged.triu(1) == 0).all()) and bool((ranged[3:, 3] == 1).all()) and bool((ranged[4, :5] == 1).all())


@pytest.mark.parametrize("attention", ["bidirectional", "unidirectional"])
def test_local_sliding_window_rules(attention: str) -> None:
    lay = LocalSlidingWindowSparsityConfig(3, 16, num_sliding_window_blocks=5, attention=attention).make_layout(16 * 10)
    assert lay.shape == (3, 10, 10) and all(torch.equal(lay[0], lay[h]) for h in range(3))
    for i in range(10):
        for j in range(10):
            inside = abs(i - j) <= 2 and (attention == "bidirectional" or j <= i)
            assert lay[0, i, j] == int(inside), (i, j)
    with pytest.raises(ValueError, match="exceeds the number of blocks"):
        LocalSlidingWindowSparsityConfig(1, 16, num_sliding_window_blocks=5).make_layout(64)
    with pytest.raises(ValueError, match="unidirectional"):
        LocalSlidingWindowSparsityConfig(1, 16, attention="causal")


def test_same_layout_for_every_head_unless_asked() -> None:
    lay = BigBirdSparsityConfig(4, 16, num_random_blocks=2).make_layout(512)
    assert all(torch.equal(lay[0], lay[h]) for h in range(4))


def test_padding_is_announced(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dscompile.sparsity"):
        lay = FixedSparsityConfig(2, 16).make_layout(100)
    assert lay.shape == (2, 7, 7)
    assert "not a multiple" in caplog.text and "112" in caplog.text
    mask = layout_to_mask(lay, 16, 100)
    assert mask.shape == (2, 100, 100)


def test_config_section_parses_deepspeed_keys() -> None:
    cfg = parse_sparse_attention({"mode": "bigbird", "block": 32, "num_random_blocks": 2, "num_sliding_window_blocks": 3,
                                  "num_global_blocks": 1, "attention": "bidirectional", "different_layout_per_head": True})  # fmt: skip
    obj = cfg.sparsity_config(4)
    assert isinstance(obj, BigBirdSparsityConfig) and obj.block == 32 and obj.num_random_blocks == 2
    assert isinstance(parse_sparse_attention({"mode": "fixed"}).sparsity_config(2), FixedSparsityConfig)
    defaults = parse_sparse_attention({"mode": "variable"}).sparsity_config(2)
    assert defaults.local_window_blocks == [4] and defaults.global_block_indices == [0]


def test_config_section_errors_name_the_key() -> None:
    with pytest.raises(DSCompileConfigError, match=r"sparse_attention\.num_local_blocks.*bigbird|num_local_blocks.*fixed"):
        parse_sparse_attention({"mode": "bigbird", "num_local_blocks": 4})
    with pytest.raises(DSCompileConfigError, match="mode"):
        parse_sparse_attention({"mode": "sparse"})
    with pytest.raises(DSCompileConfigError, match="num_randm_blocks"):
        parse_sparse_attention({"mode": "bigbird", "num_randm_blocks": 1})
    with pytest.raises(DSCompileConfigError, match="divisible"):
        parse_sparse_attention({"mode": "fixed", "num_local_blocks": 4, "num_global_blocks": 3})
    with pytest.raises(DSCompileConfigError, match="block"):
        SparseAttentionConfig(block=0).validate()


def test_config_maps_to_the_pass() -> None:
    from dscompile.config import load_config
    from dscompile.pipeline import pipeline_from_config

    config = load_config({"sparse_attention": {"mode": "bslongformer", "num_sliding_window_blocks": 5}, "lower": "eager"})
    invocations = pipeline_from_config(config)
    assert invocations[0].name == "sparse_attention"
    assert invocations[0].options.mode == "bslongformer" and invocations[0].options.num_sliding_window_blocks == 5
    assert "sparse_attention(mode=bslongformer,num_sliding_window_blocks=5)" == invocations[0].spec()
