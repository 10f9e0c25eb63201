"""The core of DeepSpeedExamples' compression/gpt2/run_clm_no_trainer.py (ZeroQuant), on a tiny GPT-2:

    deepspeed compress_gpt2.py --deepspeed --deepspeed_config ds_config.json --out result.json --save clean.pt

As the example: the perplexity of the model, ``convert_conv1d_to_linear(model, Conv1D)``,
``init_compression``; training inside a function that wraps the model with ``deepspeed.initialize``
(the script's AdamW and linear scheduler, the config's gradient accumulation and clipping) and calls
the engine (``output_hidden_states``, ``output_attentions``); then, outside it, the model itself is
evaluated, cleaned with ``redundancy_clean``, evaluated again and its state_dict saved. Changes to the
example: a GPT-2 built from a tiny config (eager attention, no dropout, whose masks under Inductor
are not eager PyTorch's), synthetic token blocks, CPU, torch's AdamW (transformers 5 has no AdamW)
and ``Conv1D`` from ``transformers.pytorch_utils`` (where transformers 5 keeps it).
"""

import argparse
import math
import os

import deepspeed
import numpy as np
import torch
from deepspeed.compression.compress import init_compression, redundancy_clean
from deepspeed.compression.helper import convert_conv1d_to_linear
from ds_models import report
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler, set_seed
from transformers.pytorch_utils import Conv1D

parser = argparse.ArgumentParser(description="compression/gpt2, tiny")
parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
parser.add_argument("--seed", type=int, default=1234)
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--weight_decay", type=float, default=0.0)
parser.add_argument("--per_device_train_batch_size", type=int, default=4)
parser.add_argument("--micro_steps", type=int, default=8)
parser.add_argument("--num_warmup_steps", type=int, default=1)
parser.add_argument("--not_tie_wre", action="store_true", help="untie the word embeddings and the LM head (the example's flag)")
parser.add_argument("--out", type=str, default=None)
parser.add_argument("--save", type=str, default=None)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

VOCAB, BLOCK = 128, 16
deepspeed.init_distributed()
set_seed(args.seed)


def lm_blocks(samples, seed):
    """group_texts' output: token blocks whose labels are the inputs (the model shifts them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, BLOCK), generator=g)
    return [{"input_ids": row, "attention_mask": torch.ones(BLOCK, dtype=torch.long), "labels": row.clone()} for row in ids]


config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=1, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0, attn_implementation="eager")  # fmt: skip
if args.not_tie_wre:
    config.tie_word_embeddings = False
model = GPT2LMHeadModel(config)
train_dataset, eval_dataset = lm_blocks(64, seed=1), lm_blocks(16, seed=2)
train_sampler = RandomSampler(train_dataset) if args.local_rank == -1 else DistributedSampler(train_dataset)
train_dataloader = DataLoader(train_dataset, collate_fn=default_data_collator, sampler=train_sampler, batch_size=args.per_device_train_batch_size)
eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, sampler=SequentialSampler(eval_dataset), batch_size=4)
num_p = sum([p.numel() for p in model.parameters()])


def evaluation(model, eval_dataloader):
    """The example's perplexity, keeping the per-batch losses it averages."""
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        losses.append(outputs.loss.cpu().item())
    try:
        perplexity = math.exp(np.mean(losses))
    except OverflowError:
        perplexity = float("inf")
    return perplexity, losses


def training(model, train_dataloader, eval_dataloader, args):
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
    lr_scheduler = get_scheduler(name="linear", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps, num_training_steps=args.micro_steps)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args, lr_scheduler=lr_scheduler, dist_init_required=True)
    losses = []
    perplexity, _ = evaluation(model, eval_dataloader)
    print(f"initialization with {perplexity}", flush=True)
    model.train()
    for step, batch in enumerate(train_dataloader):
        if step == args.micro_steps:
            break
        outputs = model(**batch, output_hidden_states=True, output_attentions=True)
        loss = outputs.loss
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    return losses


initial, _ = evaluation(model, eval_dataloader)
model = convert_conv1d_to_linear(model, Conv1D)
model = init_compression(model, args.deepspeed_config)
losses = training(model, train_dataloader, eval_dataloader, args)
before, before_losses = evaluation(model, eval_dataloader)
model = redundancy_clean(model, args.deepspeed_config)
after, after_losses = evaluation(model, eval_dataloader)
print(f"perplexity: initial {initial} before cleaning {before} after cleaning {after}", flush=True)
model_to_save = model.module if hasattr(model, "module") else model
if args.save:
    torch.save(model_to_save.state_dict(), args.save)
report(args.out, {"losses": losses, "initial": initial, "eval": [before_losses], "eval_clean": [after_losses], "params_before": num_p,
                  "shapes": {n: list(p.shape) for n, p in model_to_save.named_parameters()},
                  "params": sum(p.numel() for p in model_to_save.parameters())})  # fmt: skip
