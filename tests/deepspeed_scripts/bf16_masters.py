"""Training in the idiom of DeepSpeed's bf16_master_weight example: the config file given to
``deepspeed.initialize(config=path)``, a PyTorch-style ``loss.backward()`` then ``model_engine.step()``,
and ``model_engine.destroy()`` at the end. With ``bf16.bf16_master_weights_and_grads`` and
``bf16_optimizer_states`` the master weights, gradients and Adam moments are bf16.

    torchrun bf16_masters.py --deepspeed_config configs/bf16_full.json
"""

import argparse

import deepspeed
import torch
from ds_models import TinyTransformer, report, token_batches

parser = argparse.ArgumentParser(description="bf16 master weights")
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--out", type=str, default=None)
parser.add_argument("--deepspeed", action="store_true")
parser.add_argument("--deepspeed_config", type=str, required=True)
args = parser.parse_args()

deepspeed.init_distributed()
torch.manual_seed(42)
model = TinyTransformer()
model_engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed_config)
model_engine.train()
loss_fn = torch.nn.CrossEntropyLoss()
rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
losses = []
for input_ids, labels in token_batches(rank, model_engine.train_micro_batch_size_per_gpu(), args.steps):
    logits = model_engine(input_ids)
    loss = loss_fn(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
    loss.backward()
    model_engine.step()
    mean = loss.detach().clone()
    deepspeed.comm.all_reduce(mean)
    losses.append(mean.item() / world)
    if rank == 0:
        print(f"step {len(losses) - 1} loss {losses[-1]:.6f}", flush=True)
moments = [v for state in optimizer.state.values() for k, v in state.items() if k == "exp_avg"]
report(
    args.out,
    {
        "losses": losses,
        "param_dtype": str(next(model_engine.module.parameters()).dtype),
        "moment_dtypes": sorted({str(m.dtype) for m in moments}),
        "state_dtype": str(model_engine.module.state_dict()["output_proj.weight"].dtype),
    },
)
model_engine.destroy()
