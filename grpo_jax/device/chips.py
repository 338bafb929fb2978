"""Accelerator chips' public specs (HBM, peak bf16 FLOP/s, HBM bandwidth) for `grpo_jax.api.plan`'s roofline.

Sources, per chip (dense bf16, no sparsity; HBM as the vendor states it, read as GiB):
- TPU v4: 275 TFLOP/s, 32 GiB, 1,200 GB/s — cloud.google.com/tpu/docs/v4
- TPU v5e: 197 TFLOP/s, 16 GiB, 819 GB/s — cloud.google.com/tpu/docs/v5e
- TPU v5p: 459 TFLOP/s, 95 GiB, 2,765 GB/s — cloud.google.com/tpu/docs/v5p
- TPU v6e (Trillium): 918 TFLOP/s, 32 GiB, 1,640 GB/s — cloud.google.com/tpu/docs/v6e
- A100 SXM 80GB: 312 TFLOP/s, 80 GiB, 2,039 GB/s — NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100)
- H100 SXM: 989 TFLOP/s, 80 GiB, 3,350 GB/s — NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100)
- H200 SXM: 989 TFLOP/s, 141 GB, 4,800 GB/s — NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200)
"""

from __future__ import annotations

from typing import NamedTuple

GIB = 2 ** 30


class Chip(NamedTuple):
    """One accelerator chip: what a plan divides by."""

    name: str
    hbm_bytes: int
    bf16_flops: float  # peak dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s


CHIPS = {
    "v4": Chip("TPU v4", 32 * GIB, 275e12, 1200e9),
    "v5e": Chip("TPU v5e", 16 * GIB, 197e12, 819e9),
    "v5p": Chip("TPU v5p", 95 * GIB, 459e12, 2765e9),
    "v6e": Chip("TPU v6e", 32 * GIB, 918e12, 1640e9),
    "a100": Chip("A100 80GB", 80 * GIB, 312e12, 2039e9),
    "h100": Chip("H100", 80 * GIB, 989e12, 3350e9),
    "h200": Chip("H200", 141 * 10 ** 9, 989e12, 4800e9),
}

# jax's device_kind of a device at hand -> CHIPS key (the first substring found wins)
DEVICE_KINDS = (("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v5", "v5p"),
                ("TPU v6 lite", "v6e"), ("TPU v6e", "v6e"), ("TPU7x", None), ("A100", "a100"), ("H100", "h100"),
                ("H200", "h200"))


def topology_chip(topology: str) -> Chip:
    """The chip of a TPU topology name such as ``v5p:4x4x4``; a one-line error for an unknown generation."""
    generation = topology.split(":", 1)[0].lower()
    if generation not in CHIPS or not generation.startswith("v"):
        known = ", ".join(k for k in CHIPS if k.startswith("v"))
        raise ValueError(f"--topology {topology!r}: unknown TPU generation {generation!r}; use one of {known} with "
                         "a shape, e.g. v5p:4x4x4 or v6e:8x8, or --topology local")
    return CHIPS[generation]


def device_chip(device_kind: str) -> Chip | None:
    """The chip of a device at hand by its ``device_kind``; None when the table has none (a CPU)."""
    for needle, key in DEVICE_KINDS:
        if needle.lower() in device_kind.lower():
            return CHIPS[key] if key else None
    return None
