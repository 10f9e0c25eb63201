"""Image classification in the idiom of DeepSpeed's CIFAR-10 tutorial (ZeRO 0-3, bf16 optional).

    deepspeed cifar.py --deepspeed --deepspeed_config ds_config.json     (or torchrun)

``--engine-api`` uses the DeepSpeed engine's accessors for placement and precision
(``local_rank``, ``bfloat16_enabled()``, ``train_batch_size()``, ...) as the tutorial does;
without it the script asks deepspeed.comm and the accelerator instead.
"""

import argparse

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from ds_models import Net, image_dataset, report

parser = argparse.ArgumentParser(description="CIFAR")
parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--out", type=str, default=None)
parser.add_argument("--engine-api", action="store_true")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed()
torch.manual_seed(0)
net = Net()
parameters = filter(lambda p: p.requires_grad, net.parameters())
model_engine, optimizer, trainloader, __ = deepspeed.initialize(args=args, model=net, model_parameters=parameters, training_data=image_dataset())

if args.engine_api:
    local_device = get_accelerator().device_name(model_engine.local_rank)
    target_dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else torch.half if model_engine.fp16_enabled() else None
    per_rank = model_engine.train_micro_batch_size_per_gpu() * model_engine.gradient_accumulation_steps()
    assert model_engine.train_batch_size() == per_rank * deepspeed.comm.get_world_size()
else:
    local_device = get_accelerator().device_name(deepspeed.comm.get_local_rank())
    target_dtype = None

criterion = torch.nn.CrossEntropyLoss()
losses = []
for step, data in enumerate(trainloader):
    if step == args.steps:
        break
    inputs, labels = data[0].to(local_device), data[1].to(local_device)
    if target_dtype is not None:
        inputs = inputs.to(target_dtype)
    outputs = model_engine(inputs)
    loss = criterion(outputs.float(), labels)
    model_engine.backward(loss)
    model_engine.step()
    mean = loss.detach().float().clone()
    deepspeed.comm.all_reduce(mean)
    losses.append(mean.item() / deepspeed.comm.get_world_size())
    if deepspeed.comm.get_rank() == 0:
        print(f"step {step} loss {losses[-1]:.6f}", flush=True)
# the trained weights, gathered where ZeRO-3 partitioned them (the idiom DeepSpeed's examples save a model with)
with deepspeed.zero.GatheredParameters(list(net.parameters())):
    weights = {name: p.detach().float().flatten().tolist() for name, p in net.named_parameters()}
report(args.out, {"losses": losses, "weights": weights})
