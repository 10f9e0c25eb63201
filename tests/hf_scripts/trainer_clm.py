"""A Hugging Face Trainer script in the usual idiom: a causal LM, ``TrainingArguments(deepspeed=...)``, train, evaluate, save.

The tests run it three ways under torchrun: as written with no ds_config (the plain Trainer, the reference),
with its ``from transformers import Trainer, TrainingArguments`` line swapped for dscompile's (``--deepspeed``
names a ds_config), and unmodified with ``--deepspeed`` (the Trainer driving DeepSpeed itself). The model is a
tiny GPT-2 or Llama built from a config (no download), the data random tokens; rank 0 writes what the Trainer
logged to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

# isort: split
from transformers import Trainer, TrainingArguments

VOCAB = 96
SEQ = 16


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random sequences (every sample the same length, so every rank has the same number of labels)."""

    def __init__(self, count: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=SEQ, attention_dropout=0.0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", default=None, help="a ds_config.json")
    parser.add_argument("--out", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "llama"])
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--eval_before", action="store_true", help="evaluate before training too (DeepSpeed's Trainer path allows it at ZeRO-3 only)")
    parser.add_argument("--best", action="store_true", help="evaluate and save every 2 steps, keep the best model at the end")
    cli = parser.parse_args()

    args = TrainingArguments(
        output_dir=cli.output_dir,
        deepspeed=cli.deepspeed,
        per_device_train_batch_size=cli.batch,
        per_device_eval_batch_size=cli.batch,
        gradient_accumulation_steps=cli.accumulation,
        learning_rate=cli.lr,
        weight_decay=0.01,
        warmup_steps=0,
        use_cpu=not torch.cuda.is_available(),  # accelerate runs several CPU processes only when told
        max_steps=cli.max_steps,
        max_grad_norm=1.0,
        bf16=cli.bf16,
        logging_steps=1,
        save_strategy="steps" if cli.save_steps or cli.best else "no",
        save_steps=2 if cli.best else cli.save_steps or 500,
        eval_strategy="steps" if cli.best else "no",
        eval_steps=2,
        load_best_model_at_end=cli.best,
        metric_for_best_model="eval_loss",
        greater_is_better=True,  # keep the worst model: the loss falls here, so the one brought back is not the last
        report_to=[],
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = build_model(cli.model)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(cli.samples, 1), eval_dataset=RandomTokens(8, 2))
    before = trainer.evaluate()["eval_loss"] if cli.eval_before else None
    result = trainer.train(resume_from_checkpoint=cli.resume)
    after = trainer.evaluate()["eval_loss"]
    saved = os.path.join(cli.output_dir, "final")
    trainer.save_model(saved)
    if trainer.is_world_process_zero():
        logged = [entry for entry in trainer.state.log_history if "loss" in entry and "step" in entry]
        record = {
            "steps": [entry["step"] for entry in logged],
            "losses": [entry["loss"] for entry in logged],
            "grad_norms": [entry.get("grad_norm") for entry in logged],
            "learning_rates": [entry["learning_rate"] for entry in logged],
            "eval_before": before,
            "eval_after": after,
            "best_checkpoint": trainer.state.best_model_checkpoint,
            "evals": [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry],
            "global_step": result.global_step,
            "saved": saved,
            "world_size": args.world_size,
        }
        with open(cli.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
