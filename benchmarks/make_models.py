"""Builds the benchmark's Hugging Face model folders (random Qwen2 'tiny' and 'small') and a prompt JSONL.

    python benchmarks/make_models.py --out benchmarks/models           # tiny/, small/, prompts.jsonl
    python benchmarks/make_models.py --out /tmp/bm --sizes gemma3-1b-6l qwen3-moe-2l   # other families' shapes

Each folder holds config.json, model.safetensors and a 128-token character tokenizer
(`PreTrainedTokenizerFast`, <eos> and <pad>), so TRL's GRPOTrainer and grpo_jax load the same files.
Prompts are fixed-length "reverse" puzzles (15 characters + '>', answer = the reversed string) so both
trainers see identical prompt lengths; `grpo_jax.data.task:char_accuracy` scores them.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

EOS, PAD, UNK = "<eos>", "<pad>", "<unk>"
# 95 printable ASCII + 30 Latin-1 characters + 3 special tokens = 128 ids
CHARS = tuple(chr(c) for c in range(32, 127)) + tuple(chr(c) for c in range(161, 191))
VOCAB_SIZE = 3 + len(CHARS)
PROMPT_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"

# Qwen2 shapes of the issue; tied embeddings; HF's default init (normal, std 0.02)
SIZES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1408),
    # Qwen2.5-0.5B shapes (GPU runs; not built by default: 494M parameters)
    "qwen0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, vocab_size=151936, rope_theta=1000000.0),
    # google/gemma-3-1b-it's config.json (hidden 1152, 4/1 heads of 256, GeGLU 6912, window 512, 5 local : 1
    # global, RoPE 1e6 global / 1e4 local), its first 6 of 26 layers, the character vocabulary
    "gemma3-1b-6l": dict(model_type="gemma3_text", hidden_size=1152, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, intermediate_size=6912, query_pre_attn_scalar=256,
                         sliding_window=512, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                         hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768),
    # Qwen/Qwen3-30B-A3B's config.json (hidden 2048, 32/4 heads of 128, top-8 routing, expert width 768,
    # normalised top-k), 2 of its 48 layers and 32 of its 128 experts (a CPU step of both trainers fits in memory)
    "qwen3-moe-2l": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                         num_experts=32, num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1000000.0,
                         tie_word_embeddings=False, max_position_embeddings=40960),
}


def build_tokenizer(path: str | os.PathLike | None = None):
    """128-token character tokenizer (ids 0-2 = <eos>, <pad>, <unk>); saved to `path` if given."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate((EOS, PAD, UNK) + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()  # join characters without spaces
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=PAD,
                                                     unk_token=UNK, padding_side="left",
                                                     clean_up_tokenization_spaces=False)
    if path is not None:
        tokenizer.save_pretrained(os.fspath(path))
    return tokenizer


def qwen2_config(size: str):
    """The transformers `Qwen2Config` of a benchmark size (fp32, tied embeddings)."""
    from transformers import Qwen2Config

    kwargs = dict(SIZES[size])
    vocab_size = kwargs.pop("vocab_size", VOCAB_SIZE)
    return Qwen2Config(vocab_size=vocab_size, tie_word_embeddings=True, max_position_embeddings=2048,
                       rms_norm_eps=1e-6, eos_token_id=0, pad_token_id=1, bos_token_id=None,
                       torch_dtype="float32", use_sliding_window=False, **kwargs)


def family_config(size: str):
    """The transformers config of a `SIZES` entry of another family (``model_type`` given), fp32."""
    from transformers import AutoConfig

    kwargs = dict(SIZES[size])
    model_type = kwargs.pop("model_type")
    kwargs.setdefault("tie_word_embeddings", True)
    return AutoConfig.for_model(model_type, vocab_size=VOCAB_SIZE, rms_norm_eps=1e-6, eos_token_id=0,
                                pad_token_id=1, bos_token_id=None, torch_dtype="float32", **kwargs)


def build_model(size: str, path: str | os.PathLike, seed: int = 0) -> Path:
    """Writes a random-init model of `size` (Qwen2ForCausalLM, or the `model_type` of the entry) plus the
    tokenizer into `path`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    torch.manual_seed(seed)
    config = family_config(size) if "model_type" in SIZES[size] else qwen2_config(size)
    model = AutoModelForCausalLM.from_config(config).float()
    model.generation_config = GenerationConfig(eos_token_id=0, pad_token_id=1)
    model.save_pretrained(path)
    build_tokenizer(path)
    return path


def make_prompts(n: int, seed: int = 0, length: int = 15, max_length: int | None = None) -> list[dict]:
    """`n` rows {"prompt": s + ">", "answer": reversed s} with s of `length` random characters (with `max_length`:
    of a length drawn uniformly from [length, max_length] per row)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        size = length if max_length is None else int(rng.integers(length, max_length + 1))
        s = "".join(PROMPT_CHARS[i] for i in rng.integers(0, len(PROMPT_CHARS), size=size))
        rows.append({"prompt": s + ">", "answer": s[::-1]})
    return rows


def write_prompts(path: str | os.PathLike, n: int = 512, seed: int = 0) -> Path:
    """Writes `make_prompts(n, seed)` as JSONL."""
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in make_prompts(n, seed)))
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/models")
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(SIZES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for size in args.sizes:
        print("wrote", build_model(size, out / size, args.seed))
    print("wrote", write_prompts(out / "prompts.jsonl", seed=args.seed))


if __name__ == "__main__":
    main()
