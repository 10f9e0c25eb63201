"""DeepSpeed's text-generation inference script (``init_inference``, ``engine.generate``) ports by changing its
imports: the texts equal Hugging Face's greedy generate and DeepSpeed's.

Apart from ``test_deepspeed_scripts.py`` (whose harness it uses) so that the two run on different workers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_deepspeed_scripts import HAVE_DEEPSPEED, Runs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="session")
def run(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("deepspeed_scripts_generation"))


@pytest.fixture(scope="session")
def causal_lms(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny GPT-2 and Llama saved with a word-level tokenizer (from configs: no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("causal_lms")
    words = "deepspeed is a machine learning framework he working on peace the only way".split()
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, "<s>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    vocab.update({f"w{i}": len(vocab) + i for i in range(48 - len(vocab))})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    ids = {"bos_token_id": 3, "eos_token_id": 2, "pad_token_id": 1, "initializer_range": 0.5}
    torch.manual_seed(0)
    built = {
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=48, n_positions=64, n_embd=32, n_layer=2, n_head=4, **ids)),
        "llama": LlamaForCausalLM(
            LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **ids)
        ),
    }
    for name, model in built.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


def generation_reference(model_dir: Path, max_new_tokens: int = 10) -> list[str]:
    """The same prompts through Hugging Face's own greedy generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokens = tokenizer(["deepspeed is a machine learning framework", "he is working on", "peace is the only way"], return_tensors="pt", padding=True)
    return tokenizer.batch_decode(model.generate(**tokens, max_new_tokens=max_new_tokens, do_sample=False), skip_special_tokens=True)


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.extended), "llama"])
def test_text_generation_with_mp_size_under_torchrun(run, causal_lms, name):
    """inference-test.py's idiom: init_inference(mp_size=world_size) under torchrun (the engine sets up the
    process group), engine.generate(**tokens): the texts equal Hugging Face's greedy generate, and
    engine.config is the model's config as in DeepSpeed."""
    result = run("text_generation.py", {}, "--model", str(causal_lms / name))
    assert result["texts"] == generation_reference(causal_lms / name)
    assert result["model_config"].endswith("Config") and result["model_config"] != "InferenceConfig"


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=pytest.mark.extended)])
def test_same_text_as_deepspeed(run, causal_lms, name):
    """The same greedy texts as DeepSpeed's engine, each rank a whole model (mp_size 1): on CPU DeepSpeed's AutoTP
    all-reduce (its shm kernel) crashes at mp_size 2, and it refuses AutoTP for GPT-2; mp_size 2 is compared with
    Hugging Face's generate above."""
    extra = ("--model", str(causal_lms / name), "--mp_size", "1")
    assert run("text_generation.py", {}, *extra)["texts"] == run("text_generation.py", {}, *extra, framework="deepspeed")["texts"]
