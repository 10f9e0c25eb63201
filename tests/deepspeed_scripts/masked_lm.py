"""Masked-LM pre-training of a tiny Hugging Face RoBERTa in the idiom of DeepSpeed's HelloDeepSpeed example.

    torchrun masked_lm.py --deepspeed --deepspeed_config ds_config.json

The config is read by the script and handed over as a dict (``deepspeed.initialize(config=...)``), the engine
is called ``model`` as there, and the script uses what that example and DeepSpeed's docs reach through the
engine: the wrapped model's own methods (``model.num_parameters()``), ``tput_timer``, ``see_memory_usage``,
``save_checkpoint(client_state=...)`` / ``load_checkpoint`` and ``model.module.state_dict()``.
"""

import argparse
import json
import os

import deepspeed
import torch
from deepspeed.runtime.utils import see_memory_usage
from ds_models import masked_batches, report, tiny_roberta

parser = argparse.ArgumentParser(description="masked LM")
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--out", type=str, default=None)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

with open(args.deepspeed_config) as f:
    ds_config = json.load(f)
torch.manual_seed(0)
net = tiny_roberta()
model, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=ds_config)
see_memory_usage("after initialize", force=True)
assert model.num_parameters() == sum(p.numel() for p in net.parameters())  # the wrapped model's method, through the engine

rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
model.train()
losses = []
for step, batch in enumerate(masked_batches(rank, model.train_micro_batch_size_per_gpu(), args.steps)):
    loss = model(**{k: v.to(model.device) for k, v in batch.items()}).loss
    model.backward(loss)
    model.step()
    mean = loss.detach().float().clone()
    deepspeed.comm.all_reduce(mean)
    losses.append(mean.item() / world)
    if rank == 0:
        print(f"step {step} loss {losses[-1]:.6f}", flush=True)

checkpoint_dir = os.path.join(os.path.dirname(args.out or "."), "masked_lm_ckpt")
model.save_checkpoint(save_dir=checkpoint_dir, client_state={"checkpoint_step": args.steps})
saved = {k: v.clone() for k, v in model.module.state_dict().items()}
_, client_state = model.load_checkpoint(load_dir=checkpoint_dir)
reloaded = model.module.state_dict()
report(
    args.out,
    {
        "losses": losses,
        "samples_per_sec": model.tput_timer.avg_samples_per_sec(),
        "timed_steps": model.tput_timer.global_step_count,
        "client_step": client_state["checkpoint_step"],
        "state_dtype": str(saved["roberta.embeddings.word_embeddings.weight"].dtype),
        "reload_equal": all(torch.equal(saved[k], reloaded[k]) for k in saved),
    },
)
