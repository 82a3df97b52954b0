"""Shared fixtures: tiny random-init models built from configs (no downloads), fp32 for exactness."""

from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from specextend.models import make_pair

VOCAB = 97
torch.set_num_threads(1)  # tiny models gain nothing from threads; one thread keeps runs steady on a busy machine


def tiny(family: str = "llama", layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, seed: int = 0,
         max_positions: int = 4096):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                  initializer_range=0.3, tie_word_embeddings=False)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=hidden // heads))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    elif family == "llama3":  # Llama 3.1's frequency-dependent rope scaling, on a short original context
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        model = LlamaForCausalLM(LlamaConfig(**common, rope_scaling=rope))
    elif family == "linear":  # Vicuna 16K's kind: positions interpolated linearly
        model = LlamaForCausalLM(LlamaConfig(**{**common, "max_position_embeddings": max_positions // 4},
                                             rope_scaling={"type": "linear", "factor": 4.0}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return model.float().eval()


def save_tiny(path, tokenizer, vocab_rows: int, seed: int, layers: int, weights: bool = True, max_positions: int = 4096,
              **config):
    """A tiny Llama folder: config (`config` overrides), `tokenizer` and, unless not `weights`, random weights
    (seeded by `seed`) with `vocab_rows` embedding rows."""
    torch.manual_seed(seed)
    llama = LlamaConfig(vocab_size=vocab_rows, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions, **config)
    if weights:
        LlamaForCausalLM(llama).save_pretrained(path)
    else:
        llama.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_pair(folder, tokenizer, max_positions: int = 2048, end_ids: tuple[int, ...] = ()) -> list:
    """A tiny target (2 layers) and draft (1 layer) saved with `tokenizer` under `folder`; `end_ids`: a generation
    config listing these end ids beside the tokenizer's."""
    from transformers import GenerationConfig

    paths = []
    for seed, layers in ((1, 2), (2, 1)):
        path = save_tiny(folder / f"model{seed}", tokenizer, len(tokenizer), seed, layers, max_positions=max_positions,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
        if end_ids:
            GenerationConfig(eos_token_id=[tokenizer.eos_token_id, *end_ids]).save_pretrained(path)
        paths.append(path)
    return paths


def bigram_target(seed: int = 1):
    """A Llama whose layers add nothing: its next token depends on the last token only, so its greedy output
    soon repeats itself, and lookup drafting has something to copy (random tiny models rarely repeat)."""
    model = tiny("llama", layers=2, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


@pytest.fixture(scope="session")
def bigram_pair():
    return make_pair(bigram_target(), tiny("llama", layers=1, hidden=32, heads=2, kv_heads=1, seed=2))


@pytest.fixture(scope="session")
def llama_pair():
    return make_pair(tiny("llama", layers=3, seed=1), tiny("llama", layers=1, hidden=32, heads=2, kv_heads=1, seed=2))


@pytest.fixture(scope="session")
def qwen_pair():
    return make_pair(tiny("qwen2", layers=2, seed=3), tiny("qwen2", layers=1, hidden=32, heads=2, kv_heads=1, seed=4))


def reference_greedy(model, prompt: list[int], n: int, cached: bool = False) -> list[int]:
    """The target's own greedy output from transformers' forward with SDPA: by full recomputation (no cache), or,
    `cached`, through transformers' own KV cache (none of the engine's cache code), where recomputing every token's
    whole sequence costs too much (a real model: a minute for 20 tokens of a 400-token prompt on two cores; a
    generation of hundreds of tokens)."""
    if cached:
        from transformers import DynamicCache

        out, cache, feed = [], DynamicCache(), list(prompt)
        with torch.inference_mode():
            for _ in range(n):
                logits = model(input_ids=torch.tensor([feed]), cache=cache, use_cache=True, logits_to_keep=1).logits
                out.append(int(logits[0, -1].argmax()))
                feed = out[-1:]
        return out
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]
