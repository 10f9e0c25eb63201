"""ZeRO-3 with the model built already partitioned (deepspeed.zero.Init) and a weight set under
deepspeed.zero.GatheredParameters, in the idiom of DeepSpeed's large-model examples.

``--engine-api`` trains with ``loss.backward()`` + ``engine.step()`` and saves the 16-bit model,
as DeepSpeed's bf16 ZeRO-3 transformer example does.
"""

import argparse
import os

import deepspeed
import torch
from ds_models import Tower, report, vector_dataset

parser = argparse.ArgumentParser(description="ZeRO-3 zero.Init")
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--out", type=str, default=None)
parser.add_argument("--engine-api", action="store_true")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed()
torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
    model = Tower()
sizes = [(p.ds_numel, p.ds_tensor.numel(), p.numel()) for p in model.parameters()]
partitioned = all(full > 0 and local < full and present == 0 for full, local, present in sizes if full > 16)
with deepspeed.zero.GatheredParameters(model.head.bias, modifier_rank=0):
    if deepspeed.comm.get_rank() == 0:
        torch.nn.init.constant_(model.head.bias, 0.1)  # written on rank 0, every rank's shard gets it

engine, optimizer, trainloader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), training_data=vector_dataset())
criterion = torch.nn.CrossEntropyLoss()
losses = []
for step, (x, y) in enumerate(trainloader):
    if step == args.steps:
        break
    loss = criterion(engine(x), y)
    if args.engine_api:
        loss.backward()
    else:
        engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    deepspeed.comm.all_reduce(mean)
    losses.append(mean.item() / deepspeed.comm.get_world_size())
    if deepspeed.comm.get_rank() == 0:
        print(f"step {step} loss {losses[-1]:.6f}", flush=True)
with deepspeed.zero.GatheredParameters(list(model.parameters())):
    norms = {name: p.detach().norm().item() for name, p in model.named_parameters()}
if args.engine_api:
    engine.save_16bit_model(os.path.dirname(args.out) or ".", "model16.bin")
report(args.out, {"losses": losses, "norms": norms, "partitioned": partitioned})
