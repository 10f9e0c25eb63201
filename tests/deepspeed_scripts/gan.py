"""A GAN with two engines, in the idiom of DeepSpeed's DCGAN example: discriminator and
generator each get their own deepspeed.initialize, optimizer and step."""

import argparse

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from ds_models import Discriminator, Generator, end_reference_run, report

parser = argparse.ArgumentParser(description="GAN")
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--out", type=str, default=None)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed()
rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
device = get_accelerator().device_name(deepspeed.comm.get_local_rank())
torch.manual_seed(0)
netG, netD = Generator(), Discriminator()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
model_engineD, optimizerD, _, _ = deepspeed.initialize(args=args, model=netD, model_parameters=netD.parameters(), optimizer=optimizerD)
model_engineG, optimizerG, _, _ = deepspeed.initialize(args=args, model=netG, model_parameters=netG.parameters(), optimizer=optimizerG)
criterion = torch.nn.BCELoss()

g = torch.Generator().manual_seed(1)
real_all = torch.randn(args.steps, world * args.batch, 16, generator=g).tanh()
noise_all = torch.randn(args.steps, world * args.batch, 8, generator=g)
mine = slice(rank * args.batch, (rank + 1) * args.batch)
record = {"errD": [], "errG": []}
for step in range(args.steps):
    real, noise = real_all[step, mine].to(device), noise_all[step, mine].to(device)
    # (1) update D: maximize log(D(x)) + log(1 - D(G(z)))
    netD.zero_grad()
    label = torch.full((args.batch,), 1.0, device=device)
    errD_real = criterion(model_engineD(real), label)
    model_engineD.backward(errD_real)
    fake = model_engineG(noise)
    label.fill_(0.0)
    errD_fake = criterion(model_engineD(fake.detach()), label)
    model_engineD.backward(errD_fake)
    model_engineD.step()
    # (2) update G: maximize log(D(G(z)))
    netG.zero_grad()
    label.fill_(1.0)
    errG = criterion(netD(fake), label)  # the discriminator module itself: its engine does not train here
    model_engineG.backward(errG)
    model_engineG.step()
    for name, value in (("errD", errD_real + errD_fake), ("errG", errG)):
        mean = value.detach().clone()
        deepspeed.comm.all_reduce(mean)
        record[name].append(mean.item() / world)
    if rank == 0:
        print(f"step {step} errD {record['errD'][-1]:.6f} errG {record['errG'][-1]:.6f}", flush=True)
report(args.out, record)
end_reference_run()
