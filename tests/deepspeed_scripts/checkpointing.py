"""Activation checkpointing placed by hand with deepspeed.checkpointing, configured from the
ds_config, in the idiom of Megatron-DeepSpeed."""

import argparse

import deepspeed
import torch
from ds_models import Tower, report, vector_dataset

parser = argparse.ArgumentParser(description="checkpointing")
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--out", type=str, default=None)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed()
deepspeed.checkpointing.configure(None, deepspeed_config=args.deepspeed_config)
torch.manual_seed(0)
model = Tower(checkpoint=deepspeed.checkpointing.checkpoint)
engine, _, trainloader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), training_data=vector_dataset())
criterion = torch.nn.CrossEntropyLoss()
losses = []
for step, (x, y) in enumerate(trainloader):
    if step == args.steps:
        break
    loss = criterion(engine(x), y)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    deepspeed.comm.all_reduce(mean)
    losses.append(mean.item() / deepspeed.comm.get_world_size())
    if deepspeed.comm.get_rank() == 0:
        print(f"step {step} loss {losses[-1]:.6f}", flush=True)
report(args.out, {"losses": losses, "configured": deepspeed.checkpointing.is_configured()})
