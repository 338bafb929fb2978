"""A model folder's config.json checked against its weights before anything is built or compiled.

`check_folder` reads config.json as JSON (before transformers, whose validation of a bad config is a traceback) and
the safetensors headers (shapes only, no tensor is read), and compares the architecture keys every family shares
(llama, qwen2/3, mistral, gemma2/3, qwen3_moe, cohere2, gpt_oss): layer count and per-layer kinds, vocabulary,
hidden size, head counts and head size, MLP width, experts and their width. A mismatch is one ValueError naming the
key, the config's value and the weights' value, with the tensor that shows it.
"""

from __future__ import annotations

import json
import os
import re

from grpo_jax.models import safetensors_io as st

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.0\.mlp\.experts\.(\d+)\.")
# transformers' aliases: a config.json may hold either name (or both, which then must agree)
EXPERT_KEYS = ("num_experts", "num_local_experts")


def _raw_config(path: str) -> dict:
    where = os.path.join(path, "config.json")
    try:
        with open(where, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{where}: not readable as JSON ({type(e).__name__}: {e}): restore the folder's "
                         "config.json") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: holds a JSON {type(raw).__name__}, not an object of config keys")
    return raw


def _weights(path: str) -> dict[str, st.TensorRef] | None:
    """Tensor name -> ref from the folder's safetensors headers; None when it holds none (a config-only folder)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in (st.SINGLE_FILE, st.INDEX_FILE)):
        return None
    return st.open_folder(path)


def _shape(refs: dict, name: str) -> tuple | None:
    return refs[name].shape if name in refs else None


def _facts(refs: dict) -> dict[str, tuple[int, str]]:
    """What the weights say, by config key: key -> (value, the tensor that shows it)."""
    facts: dict[str, tuple[int, str]] = {}
    layers = {int(m.group(1)) for n in refs if (m := _LAYER.match(n))}
    if layers:
        facts["num_hidden_layers"] = (max(layers) + 1, f"model.layers.{max(layers)}.*")
    embed = _shape(refs, "model.embed_tokens.weight")
    if embed is not None and len(embed) == 2:
        facts["vocab_size"] = (embed[0], "model.embed_tokens.weight")
        facts["hidden_size"] = (embed[1], "model.embed_tokens.weight")
    gate = _shape(refs, "model.layers.0.mlp.gate_proj.weight")
    if gate is not None:
        facts["intermediate_size"] = (gate[0], "model.layers.0.mlp.gate_proj.weight")
    fused = _shape(refs, "model.layers.0.mlp.experts.gate_up_proj")  # GPT-OSS: [E, D, 2F], F its intermediate_size
    if fused is not None and len(fused) == 3:
        facts["intermediate_size"] = (fused[2] // 2, "model.layers.0.mlp.experts.gate_up_proj")
    router_name = next((n for n in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.router.weight")
                        if n in refs), None)
    experts = {int(m.group(1)) for n in refs if (m := _EXPERT.match(n))}
    if router_name is not None:
        facts["num_experts"] = (refs[router_name].shape[0], router_name)
    elif experts:
        facts["num_experts"] = (max(experts) + 1, "model.layers.0.mlp.experts.*")
    expert_gate = _shape(refs, "model.layers.0.mlp.experts.0.gate_proj.weight")
    if expert_gate is not None:
        facts["moe_intermediate_size"] = (expert_gate[0], "model.layers.0.mlp.experts.0.gate_proj.weight")
    norm = _shape(refs, "model.layers.0.self_attn.q_norm.weight")
    if norm is not None:
        facts["head_dim"] = (norm[0], "model.layers.0.self_attn.q_norm.weight")
    return facts


def _mismatch(where: str, key: str, value, weights, tensor: str, file: str) -> ValueError:
    return ValueError(f"{where}: {key}={value!r} but the weights hold {weights} ({tensor} in {file}): the folder's "
                      "config.json and weights disagree; fix config.json or point model.path at a matching folder")


def check_folder(path: str, model_types=None) -> None:
    """Raises a one-line ValueError when config.json disagrees with itself (layer_types) or with the weights'
    shapes (read from the safetensors headers only). ``model_types``: the ones checked (another is left to the
    family lookup's own message); None: any."""
    where = os.path.join(path, "config.json")
    raw = _raw_config(path)
    if model_types is not None and raw.get("model_type") not in model_types:
        return
    refs = _weights(path)
    facts = _facts(refs) if refs else {}
    file = lambda tensor: os.path.basename(refs[tensor].file) if refs and tensor in refs else "the weights"  # noqa
    for key, (weights, tensor) in facts.items():
        keys = EXPERT_KEYS if key == "num_experts" else (key,)
        for name in keys:
            value = raw.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value != weights:
                raise _mismatch(where, name, value, f"{weights}", tensor, file(tensor))
    layers = facts.get("num_hidden_layers", (raw.get("num_hidden_layers"), None))[0]
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list) and isinstance(layers, int) and len(layer_types) != layers:
        source = "the weights hold" if "num_hidden_layers" in facts else "num_hidden_layers says"
        raise ValueError(f"{where}: layer_types has {len(layer_types)} entries but {source} {layers} layers: give "
                         "one kind (full_attention or sliding_attention) per layer")
    if refs:
        _check_heads(where, raw, refs, facts, file)


def _check_heads(where: str, raw: dict, refs: dict, facts: dict, file) -> None:
    """Query and key/value heads against q_proj / k_proj rows, with the head size the config (or q_norm) gives."""
    hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        return
    head_dim = raw.get("head_dim") or facts.get("head_dim", (hidden // heads,))[0]
    kv_heads = raw.get("num_key_value_heads") or heads
    for key, value, tensor in (("num_attention_heads", heads, "model.layers.0.self_attn.q_proj.weight"),
                               ("num_key_value_heads", kv_heads, "model.layers.0.self_attn.k_proj.weight")):
        shape = _shape(refs, tensor)
        if shape is None or not isinstance(value, int) or not head_dim:
            continue
        if shape[0] != value * head_dim:
            held = f"{shape[0] / head_dim:g} heads of {head_dim} ({list(shape)})"
            raise _mismatch(where, key, value, held, tensor, file(tensor))
