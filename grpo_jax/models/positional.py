"""Where tokens sit: RoPE frequencies (transformers' rope types), rotary tables, left-padding positions and the
causal / padding / sliding-window attention mask. Shapes as in `grpo_jax.models.transformer`."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def rope_inv_freq(config, kind: str = "full_attention") -> np.ndarray:
    """Inverse frequencies [R/2] float32 of a layer kind's RoPE (R = `rotary_dim`: Dh, or its first part), as
    transformers' ``ROPE_INIT_FUNCTIONS[rope_type]``: with ``rope_local_base_freq`` (Gemma 3) sliding_attention
    layers use default RoPE of that base, every other layer ``rope_theta`` and ``rope_type``."""
    dim = config.rotary_dim
    local = kind == "sliding_attention" and config.rope_local_base_freq is not None
    theta = config.rope_local_base_freq if local else config.rope_theta
    inv_freq = (1.0 / (theta ** (np.arange(0, dim, 2).astype(np.float32) / dim))).astype(np.float32)
    if local:
        return inv_freq
    factor = np.float32(config.rope_factor)
    if config.rope_type == "linear":
        return inv_freq / factor
    if config.rope_type == "llama3":  # transformers' _compute_llama3_parameters, op for op
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        old_context_len = config.rope_original_max_position_embeddings
        low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
        wavelen = (2 * math.pi / inv_freq).astype(np.float32)
        inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = ((old_context_len / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(medium, smoothed, inv_freq_llama).astype(np.float32)
    if config.rope_type == "yarn":  # transformers' _compute_yarn_parameters, op for op
        return _yarn_inv_freq(config, theta, dim, float(factor))
    return inv_freq


def _yarn_inv_freq(config, base: float, dim: int, factor: float) -> np.ndarray:
    """YaRN's frequencies: each one interpolated (divided by ``factor``) below ``rope_beta_slow`` rotations over the
    original context, kept above ``rope_beta_fast``, ramped linearly between."""
    original = config.rope_original_max_position_embeddings

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = (base ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
    inv_extrapolated, inv_interpolated = 1.0 / pos_freqs, 1.0 / (np.float32(factor) * pos_freqs)
    return (inv_interpolated * (1 - extrapolation) + inv_extrapolated * extrapolation).astype(np.float32)


def rope_attention_scaling(config, kind: str = "full_attention") -> float:
    """What a layer kind's cos and sin are multiplied by (transformers' ``attention_scaling``): YaRN's
    ``rope_attention_factor``, by default 0.1 ln(factor) + 1 (1 for factors <= 1); 1 for every other RoPE."""
    if config.rope_type != "yarn" or (kind == "sliding_attention" and config.rope_local_base_freq is not None):
        return 1.0
    if config.rope_attention_factor is not None:
        return float(config.rope_attention_factor)
    return 1.0 if config.rope_factor <= 1 else 0.1 * math.log(config.rope_factor) + 1.0


def rope_tables(inv_freq_F, num_positions: int, scaling: float = 1.0):
    """cos, sin [num_positions, Dh/2] float32 of positions 0 .. num_positions - 1, times ``scaling``
    (`rope_attention_scaling`): one sin/cos per distinct (position, frequency), gathered by `rope_cos_sin` (XLA:CPU
    evaluates each one as a scalar libm call)."""
    freqs_SxF = jnp.arange(num_positions, dtype=jnp.int32).astype(jnp.float32)[:, None] * jnp.asarray(
        inv_freq_F, jnp.float32)
    if scaling == 1.0:
        return jnp.cos(freqs_SxF), jnp.sin(freqs_SxF)
    return jnp.cos(freqs_SxF) * scaling, jnp.sin(freqs_SxF) * scaling


def rope_cos_sin(positions_BxT, tables):
    """Rotary tables cos, sin [B, T, Dh] in float32 (HF layout: frequencies repeated twice): the `rope_tables`
    rows of the positions, which must be below their length (cos(position * inv_freq) bit for bit)."""
    def rows(table_SxF):
        rows_BxTxF = jnp.take(table_SxF, positions_BxT, axis=0, mode="fill", fill_value=jnp.nan)
        return jnp.concatenate([rows_BxTxF, rows_BxTxF], axis=-1)
    return tuple(rows(table) for table in tables)


def apply_rope(x_BxTxHxDh, cos_BxTxDh, sin_BxTxDh, interleaved: bool = False):
    """x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1]; computed in float32. ``interleaved`` (Cohere):
    pair (2i, 2i + 1) turns by frequency i, as transformers' Cohere ``rotate_half`` over interleaved tables.
    Tables narrower than the head (partial rotary, GLM-4-MoE) turn its first dims and pass the rest."""
    rotary = cos_BxTxDh.shape[-1]
    if rotary < x_BxTxHxDh.shape[-1]:
        turned = apply_rope(x_BxTxHxDh[..., :rotary], cos_BxTxDh, sin_BxTxDh, interleaved)
        return jnp.concatenate([turned, x_BxTxHxDh[..., rotary:]], axis=-1)
    x = x_BxTxHxDh.astype(jnp.float32)
    if interleaved:  # the tables' first half holds each frequency once
        half = x.shape[-1] // 2
        cos, sin = cos_BxTxDh[:, :, None, :half], sin_BxTxDh[:, :, None, :half]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(x.shape)
        return out.astype(x_BxTxHxDh.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x * cos_BxTxDh[:, :, None, :] + rotated * sin_BxTxDh[:, :, None, :]
    return out.astype(x_BxTxHxDh.dtype)


def attention_mask(attention_mask_BxS, query_slot_T, sliding_window: int | None = None, query_positions_BxT=None):
    """Boolean [B, T, S]: key slot s is visible from query slot q when s <= q and its mask is 1; with a sliding
    window W also when the query's position (``query_positions_BxT``) minus the key's is below W, a key's position
    being the visible slots before it (cumsum(mask) - 1). Where the real slots are contiguous (left padding, a
    KV cache) that is transformers' ``sliding_window_overlay`` (q - s < W); a shared-prefix layout's hidden slot
    is not counted. ``query_slot_T`` is [T], or [B, T] when rows sit at slots of their own (continuous batching)."""
    key_slot_S = jnp.arange(attention_mask_BxS.shape[1])
    query_slot_BxT = query_slot_T if query_slot_T.ndim == 2 else query_slot_T[None]
    visible_BxTxS = (query_slot_BxT[:, :, None] >= key_slot_S[None, None, :]) & (attention_mask_BxS[:, None, :] > 0)
    if sliding_window is not None:
        key_positions_BxS = jnp.cumsum(attention_mask_BxS > 0, axis=-1, dtype=jnp.int32) - 1
        visible_BxTxS &= query_positions_BxT[:, :, None] - key_positions_BxS[:, None, :] < sliding_window
    return visible_BxTxS


def positions_from_mask(mask_BxT):
    """RoPE positions for a left-padded mask: cumsum(mask) - 1, clipped at 0."""
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)
