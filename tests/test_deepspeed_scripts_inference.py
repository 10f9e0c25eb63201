"""DeepSpeed's Hugging Face inference scripts port by changing their imports: fill-mask (test-bert.py,
test-roberta.py, test-electra.py) and T5 (test-t5.py, test-t5-base.py), from ``tests/deepspeed_scripts/``.

Each runs under torchrun with its imports swapped (``test_deepspeed_scripts.swap_imports``) on tiny models saved
from configs with locally built tokenizers, and is compared with Hugging Face's own pipeline / ``generate``
without ``init_inference``, and with DeepSpeed running the unmodified copy where it runs on CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_deepspeed_scripts import HAVE_DEEPSPEED, SCRIPTS, swap_imports

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MASKED = "In Autumn the {mask} fall from the trees."
WORDS = (
    "in autumn the leaves fall from trees . review positive or negative ? : this is best cast iron skillet you will ever buy "
    "quick brown fox jumps over lazy dog translate english to french"
).split()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny BERT, RoBERTa, ELECTRA (masked LMs) and T5 saved with word-level tokenizers (no downloads)."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers import models as tok_models
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        BertTokenizerFast,
        ElectraConfig,
        ElectraForMaskedLM,
        PreTrainedTokenizerFast,
        RobertaConfig,
        RobertaForMaskedLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    root = tmp_path_factory.mktemp("inference_models")
    words = list(dict.fromkeys(WORDS + [w.capitalize() for w in WORDS]))
    torch.manual_seed(0)
    size = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64, "initializer_range": 0.5}
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    bert_tokenizer = BertTokenizerFast(vocab=str(root / "vocab.txt"), do_lower_case=False)
    vocab = len(bert_tokenizer)
    for name, model in {
        "bert": BertForMaskedLM(BertConfig(vocab_size=vocab, **size)),
        "electra": ElectraForMaskedLM(ElectraConfig(vocab_size=vocab, embedding_size=16, **size)),
    }.items():
        model.save_pretrained(root / name)
        bert_tokenizer.save_pretrained(root / name)

    def word_level(specials: list[str], template: str, marks: list[str]) -> PreTrainedTokenizerFast:
        ids = {t: i for i, t in enumerate(specials + words)}
        backend = Tokenizer(tok_models.WordLevel(ids, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        backend.post_processor = processors.TemplateProcessing(single=template, special_tokens=[(m, ids[m]) for m in marks])
        return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")

    roberta_tokenizer = word_level(["<s>", "<pad>", "</s>", "<unk>", "<mask>"], "<s> $A </s>", ["<s>", "</s>"])
    roberta_tokenizer.add_special_tokens({"bos_token": "<s>", "cls_token": "<s>", "sep_token": "</s>", "mask_token": "<mask>"})
    RobertaForMaskedLM(RobertaConfig(vocab_size=len(roberta_tokenizer), max_position_embeddings=40, pad_token_id=1, **size)).save_pretrained(root / "roberta")
    roberta_tokenizer.save_pretrained(root / "roberta")
    t5_tokenizer = word_level(["<pad>", "</s>", "<unk>"], "$A </s>", ["</s>"])
    for name, ff in (("t5", "gated-gelu"), ("t5-base", "relu")):  # t5-v1_1's gated MLP, t5-base's plain one
        t5 = T5Config(vocab_size=len(t5_tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, feed_forward_proj=ff)
        T5ForConditionalGeneration(T5Config(**{**t5.to_dict(), "decoder_start_token_id": 0, "initializer_factor": 8.0})).save_pretrained(root / name)
        t5_tokenizer.save_pretrained(root / name)
    return root


def run(workdir: Path, script: str, world: int, *extra: str, framework: str = "dscompile") -> dict[str, Any]:
    """``script`` under torchrun on ``world`` gloo ranks: imports swapped for dscompile, unmodified for DeepSpeed."""
    folder = workdir / framework
    if not folder.exists():
        shutil.copytree(SCRIPTS, folder, ignore=shutil.ignore_patterns("__pycache__"))
        if framework == "dscompile":
            for path in folder.glob("*.py"):
                path.write_text(swap_imports(path.read_text()))
    out = folder / f"{script}.{world}.{hashlib.sha1(repr(extra).encode()).hexdigest()[:10]}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), str(folder / script), *extra, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(folder), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=folder)
    if proc.returncode != 0 or not out.is_file():
        raise AssertionError(f"{framework} run of {script} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inference_scripts")


def fill_mask_reference(model_dir: Path) -> list[dict[str, Any]]:
    from transformers import pipeline

    pipe = pipeline("fill-mask", model=str(model_dir), device=-1)
    return pipe(MASKED.format(mask=pipe.tokenizer.mask_token))


def assert_same_predictions(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert [(p["token"], p["sequence"]) for p in got] == [(p["token"], p["sequence"]) for p in expected]
    torch.testing.assert_close(torch.tensor([p["score"] for p in got]), torch.tensor([p["score"] for p in expected]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name, policy",
    [pytest.param("bert", None, marks=pytest.mark.extended), ("roberta", "roberta"), pytest.param("electra", "electra", marks=pytest.mark.extended)],
)
def test_fill_mask_with_mp_size_2(models, workdir, name, policy):
    """test-bert.py / test-roberta.py / test-electra.py on 2 ranks (mp_size = world size: the model split in two,
    RoBERTa's and ELECTRA's ``injection_policy`` checked against the split): Hugging Face's pipeline reads the
    engine's output as the model's, and the predictions and scores are the unsplit model's."""
    extra = ("--model", str(models / name), *(("--policy", policy) if policy else ()))
    assert_same_predictions(run(workdir, "fill_mask.py", 2, *extra)["output"], fill_mask_reference(models / name))


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.parametrize("name, policy", [("bert", None), ("roberta", "roberta")])
def test_fill_mask_same_as_deepspeed(models, workdir, name, policy):
    """One rank (DeepSpeed's AutoTP all-reduce crashes on CPU at 2): the same predictions and scores as DeepSpeed's engine."""
    extra = ("--model", str(models / name), *(("--policy", policy) if policy else ()))
    assert_same_predictions(run(workdir, "fill_mask.py", 1, *extra)["output"], run(workdir, "fill_mask.py", 1, *extra, framework="deepspeed")["output"])


def t5_reference(model_dir: Path, text: str) -> list[list[int]]:
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    return model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=8, do_sample=False).tolist()


@pytest.mark.parametrize(
    "name, task, world",
    [("t5", "text2text", 1), ("t5-base", "translation", 2)]
    + [pytest.param(*case, marks=pytest.mark.extended) for case in [("t5", "text2text", 2), ("t5-base", "translation", 1)]],
)
def test_t5_generate(models, workdir, name, task, world):
    """test-t5.py / test-t5-base.py on one rank: engine.generate of an encoder-decoder model (Hugging Face's loop
    over the compiled forward) gives Hugging Face's greedy tokens, and DeepSpeed's where installed. On two
    (``mp_size 2``): the split encoder and decoder graphs, their all-reduces after exactly the ``injection_policy``'s
    linears (``SelfAttention.o``, ``EncDecAttention.o``, ``DenseReluDense.wo``), give the same tokens."""
    result = run(workdir, "t5_generation.py", world, "--model", str(models / name), "--task", task)
    text = "Is this review positive or negative? Review: this is the best cast iron skillet you will ever buy"
    if task == "translation":
        text = "translate English to French: The quick brown fox jumps over the lazy dog."
    assert result["ids"] == t5_reference(models / name, text)
    if HAVE_DEEPSPEED and world == 1:  # DeepSpeed's AutoTP all-reduce crashes on CPU at 2
        assert result["ids"] == run(workdir, "t5_generation.py", 1, "--model", str(models / name), "--task", task, framework="deepspeed")["ids"]
