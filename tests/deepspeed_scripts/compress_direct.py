"""Compression training in the idiom of DeepSpeed's compression examples (CIFAR channel pruning, W8A8):

    deepspeed compress_direct.py --deepspeed --deepspeed_config ds_config.json --out result.json --save clean.pt

``init_compression`` before ``deepspeed.initialize``; each step calls the model itself (``model(x)``, as
the CIFAR example does), then ``engine.backward`` and ``engine.step``; the model is evaluated directly,
cleaned with ``redundancy_clean`` and its smaller state_dict saved.
"""

import argparse
import hashlib

import deepspeed
import torch
from deepspeed.compression.compress import init_compression, redundancy_clean
from ds_models import ResidualNet, image_dataset, report

parser = argparse.ArgumentParser(description="compression with direct model calls")
parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--out", type=str, default=None)
parser.add_argument("--save", type=str, default=None)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed()
torch.manual_seed(0)
train_loader = torch.utils.data.DataLoader(image_dataset(64, seed=0), batch_size=8, shuffle=True)
model = ResidualNet()
model = init_compression(model, args.deepspeed_config)
rng = hashlib.sha1(torch.random.get_rng_state().numpy().tobytes()).hexdigest()  # where init_compression leaves the stream
model_engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())

criterion = torch.nn.CrossEntropyLoss()
losses = []
for step, (data, target) in enumerate(train_loader):
    if step == args.steps:
        break
    model_engine.train()
    output = model(data)
    loss = criterion(output, target)
    model_engine.backward(loss)
    model_engine.step()
    losses.append(loss.item())
    print(f"step {step} loss {losses[-1]:.6f}", flush=True)

images = image_dataset(16, seed=1).tensors[0]
model.eval()
with torch.no_grad():
    before = model(images)
model = redundancy_clean(model, args.deepspeed_config)
with torch.no_grad():
    after = model(images)
if args.save:
    torch.save(model.state_dict(), args.save)
report(args.out, {"losses": losses, "rng": rng, "eval": before.tolist(), "eval_clean": after.tolist()})
