"""DeepSpeed's names on two real gloo ranks: deepspeed.comm, zero.Init (sharded at construction,
adopted by the ZeRO engine), zero.GatheredParameters. One spawn runs every check."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from dscompile.testing.distributed import run_distributed_or_fail

warnings.filterwarnings("ignore", message="Failed to fetch module")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

_CREATED: list[nn.Parameter] = []
# zero.Init partitions at construction only for stage 3; stage 0 shows it changes nothing elsewhere.
# (ZeRO-1/2 against a single process: tests/test_zero.py.)
_STAGES = (0, 3)


class _Block(nn.Module):
    """Records, when built, how many elements of the earlier blocks' parameters exist in full."""

    seen_full: list[int] = []

    def __init__(self, width: int) -> None:
        super().__init__()
        _Block.seen_full.append(sum(p.numel() for p in _CREATED))
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        _CREATED.extend(self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class _Net(nn.Module):
    def __init__(self, width: int = 12, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 3)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.3)
            nn.init.constant_(module.bias, 0.01)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x), y)


def _comm_checks(rank: int, world: int) -> dict:
    import dscompile as deepspeed

    comm = deepspeed.comm
    deepspeed.init_distributed(dist_backend="gloo")  # a group exists: kept as it is
    out = {"rank": comm.get_rank(), "world": comm.get_world_size(), "local": comm.get_local_rank(), "initialized": comm.is_initialized()}
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t)
    out["sum"] = t.item()
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t, op=comm.ReduceOp.AVG, log_name="avg", debug="caller")  # gloo lacks AVG: summed and divided
    out["avg"] = t.item()
    gathered = [torch.zeros(1) for _ in range(world)]
    comm.all_gather(gathered, torch.tensor([float(rank)]))
    out["gathered"] = [g.item() for g in gathered]
    b = torch.tensor([float(rank * 7)])
    comm.broadcast(b, src=1)
    out["broadcast"] = b.item()
    flat = torch.zeros(world)
    comm.all_gather_into_tensor(flat, torch.tensor([float(rank)]))
    out["flat"] = flat.tolist()
    part = torch.zeros(1)
    comm.reduce_scatter_tensor(part, torch.ones(world) * (rank + 1))
    out["scattered"] = part.item()
    group = comm.new_group([1])
    out["global_of_group"] = comm.get_global_rank(group, 0)
    out["ranks"] = comm.get_all_ranks_from_group(None)
    comm.barrier()
    return out


def _zero_init_checks(rank: int, world: int) -> dict:
    import dscompile as deepspeed

    out: dict = {}
    _CREATED.clear()
    _Block.seen_full.clear()
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        model = _Net()
    out["seen_full"] = list(_Block.seen_full)  # the earlier blocks were sharded before the next was built
    out["shapes"] = {n: (tuple(p.shape), tuple(p.ds_shape), p.ds_tensor.numel()) for n, p in model.named_parameters()}
    torch.manual_seed(0)
    _CREATED.clear()
    plain = _Net()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["same_as_plain"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    out["freed_again"] = all(p.numel() == 0 for p in model.parameters())
    # a change on the modifier rank reaches every rank's shard; without a modifier rank nothing is kept
    with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0), torch.no_grad():
        model.head.weight.fill_(0.5 if rank == 0 else -9.0)
    with deepspeed.zero.GatheredParameters(model.head.weight), torch.no_grad():
        out["modified"] = model.head.weight.unique().tolist()
        model.head.weight.fill_(123.0)
    with deepspeed.zero.GatheredParameters(model.head.weight):
        out["unmodified"] = model.head.weight.unique().tolist()
    from dscompile.errors import DSCompileNotSupportedError
    from dscompile.zoo.hf import HFConfig, _gpt2_module

    try:
        with deepspeed.zero.Init():
            _gpt2_module(HFConfig(n_layers=1))
        out["hf"] = "built"
    except DSCompileNotSupportedError as exc:
        out["hf"] = str(exc)
    return out


def _train(rank: int, world: int, stage: int, zero_init: bool, steps: int = 2) -> dict:
    import dscompile as deepspeed

    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 12},
    }
    torch.manual_seed(0)
    _CREATED.clear()
    if zero_init:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = _Net()
        before = {n: p.ds_tensor.data_ptr() for n, p in model.named_parameters()}
    else:
        model = _Net()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    out: dict = {"losses": []}
    if zero_init and stage == 3:
        shards = dict(engine.zero.named_shards())
        out["adopted"] = all(shards[n].data_ptr() == ptr for n, ptr in before.items() if n in shards)
        out["persistent_full"] = {n: p.numel() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x, y = torch.randn(world * 4, 12, generator=g), torch.randint(0, 3, (world * 4,), generator=g)
        mine = slice(rank * 4, (rank + 1) * 4)
        loss = engine(x[mine], y[mine])
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _tied_layers() -> list:
    from dscompile.pipe import LayerSpec, TiedLayerSpec

    def head(embed: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h @ embed.weight.t()  # the output projection shares the embedding's weight

    return [
        TiedLayerSpec("embed", nn.Embedding, 11, 8),
        LayerSpec(nn.Linear, 8, 8),
        LayerSpec(nn.Linear, 8, 8),
        nn.ReLU(inplace=True),  # first layer of stage 1 under the uniform partition
        TiedLayerSpec("embed", nn.Embedding, 11, 8, forward_fn=head),
        lambda logits: logits.flatten(0, 1),
    ]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels.flatten())


def _tied_pipeline(rank: int, world: int, save_dir: str, steps: int = 2) -> dict:
    """PipelineModule with a TiedLayerSpec on both stages: the gradients of the shared weight are
    summed over the stages, as one module in one process would have them; then save_16bit_model
    writes both stages into one file on rank 0."""
    import dscompile as deepspeed
    from dscompile.pipe import PipelineModule

    torch.manual_seed(0)
    net = PipelineModule(_tied_layers(), num_stages=2, loss_fn=_loss, partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 11, (2, 5), generator=g), torch.randint(0, 11, (2, 5), generator=g)) for _ in range(2 * steps)]
    losses = [float(engine.train_batch(iter(data[2 * s : 2 * s + 2]))) for s in range(steps)]
    assert engine.save_16bit_model(save_dir, "pipe16.bin") is True
    saved = torch.load(os.path.join(save_dir, "pipe16.bin")) if rank == 0 else None
    return {"losses": losses, "partitions": net.partitions(), "params": engine.stage_parameters(), "data": data, "saved16": saved}


def _two_rank_checks(rank: int, world: int, save_dir: str) -> dict:
    out = {"comm": _comm_checks(rank, world), "zero_init": _zero_init_checks(rank, world), "tied": _tied_pipeline(rank, world, save_dir)}
    for stage in _STAGES:
        for zero_init in (False, True):
            out[("train", stage, zero_init)] = _train(rank, world, stage, zero_init)
    return out


def _reference(steps: int = 2, world: int = 2) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    _CREATED.clear()
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    g = torch.Generator().manual_seed(5)
    per_rank: list[list[float]] = [[] for _ in range(world)]
    for _ in range(steps):
        x, y = torch.randn(world * 4, 12, generator=g), torch.randint(0, 3, (world * 4,), generator=g)
        losses = [model(x[r * 4 : (r + 1) * 4], y[r * 4 : (r + 1) * 4]) for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
        for r in range(world):
            per_rank[r].append(losses[r].item())
    return per_rank, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_comm_zero_init_and_gathered_parameters_on_two_ranks(tmp_path):
    results = run_distributed_or_fail(_two_rank_checks, 2, str(tmp_path), timeout=900)
    for rank, res in enumerate(results):
        comm = res["comm"]
        assert (comm["rank"], comm["world"], comm["local"], comm["initialized"]) == (rank, 2, rank, True)
        assert (comm["sum"], comm["avg"], comm["gathered"], comm["broadcast"]) == (3.0, 1.5, [0.0, 1.0], 7.0)
        assert (comm["flat"], comm["scattered"], comm["global_of_group"], comm["ranks"]) == ([0.0, 1.0], 3.0, 1, [0, 1])

        zi = res["zero_init"]
        assert zi["seen_full"] == [0, 0, 0, 0]  # no earlier block existed in full when the next was built
        assert zi["shapes"]["blocks.0.fc.weight"] == ((0,), (12, 12), 72) and zi["shapes"]["head.bias"] == ((0,), (3,), 2)
        assert zi["same_as_plain"] and zi["freed_again"]
        assert zi["modified"] == [0.5] and zi["unmodified"] == [0.5]
        assert "transformers models built under zero.Init" in zi["hf"]  # refused: its own init would miss the shards

    torch.manual_seed(0)
    from dscompile.pipe import PipelineModule

    plain = PipelineModule(_tied_layers(), num_stages=1)
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    data = results[0]["tied"]["data"]
    for step in range(2):
        loss = sum(_loss(plain(x), y) for x, y in data[2 * step : 2 * step + 2]) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        for res in results:
            assert res["tied"]["partitions"] == [0, 3, 6]
            assert res["tied"]["losses"][step] == pytest.approx(loss.item(), rel=1e-5)
    expected = dict(plain.named_parameters())
    for res in results:
        for name, value in res["tied"]["params"].items():
            torch.testing.assert_close(value, expected[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert "tied_modules.embed.weight" in results[0]["tied"]["params"] and "tied_modules.embed.weight" in results[1]["tied"]["params"]
    saved16 = results[0]["tied"]["saved16"]  # one file, both stages, the single-process model's names and values
    assert saved16.keys() == plain.state_dict().keys()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(saved16[name], value, rtol=1e-5, atol=1e-6, msg=name)

    ref_losses, ref_params = _reference()
    for stage in _STAGES:
        for rank, res in enumerate(results):
            plain, built_sharded = res[("train", stage, False)], res[("train", stage, True)]
            # construction under zero.Init changes nothing in the numbers, bit for bit
            assert built_sharded["losses"] == plain["losses"], (stage, rank)
            for name, value in plain["params"].items():
                assert torch.equal(built_sharded["params"][name], value), (stage, name)
            torch.testing.assert_close(torch.tensor(plain["losses"]), torch.tensor(ref_losses[rank]), rtol=1e-5, atol=1e-6)
            for name, value in ref_params.items():
                torch.testing.assert_close(plain["params"][name], value, rtol=1e-4, atol=1e-5, msg=f"ZeRO-{stage} {name}")
        adopted = results[0][("train", 3, True)]
        assert adopted["adopted"]  # the engine trains the very shards zero.Init cut
        full = adopted["persistent_full"]
        assert full["head.bias"] == 3 and full["blocks.0.norm.weight"] == 12 and full["blocks.0.fc.weight"] == 0
