"""Accelerator chips' public specs (HBM, peak bf16 FLOP/s, HBM bandwidth) for `grpo_jax.api.plan`'s roofline.

Sources, per chip (dense bf16, no sparsity; HBM as the vendor states it, read as GiB):
- TPU v4: 275 TFLOP/s, 32 GiB, 1,200 GB/s — cloud.google.com/tpu/docs/v4
- TPU v5e: 197 TFLOP/s, 16 GiB, 819 GB/s — cloud.google.com/tpu/docs/v5e
- TPU v5p: 459 TFLOP/s, 95 GiB, 2,765 GB/s — cloud.google.com/tpu/docs/v5p
- TPU v6e (Trillium): 918 TFLOP/s, 32 GiB, 1,640 GB/s — cloud.google.com/tpu/docs/v6e
- A100 SXM 80GB: 312 TFLOP/s, 80 GiB, 2,039 GB/s — NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100)
- H100 SXM: 989 TFLOP/s, 80 GiB, 3,350 GB/s — NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100)
- H200 SXM: 989 TFLOP/s, 141 GB, 4,800 GB/s — NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200)

Interconnect, one way per chip (the vendor's figure over its links), and the links a ring over one group uses:
- TPU v4: 2,400 Gbps over 6 links (3D torus); v5p: 4,800 Gbps (1,200 GB/s bidirectional) over 6; v5e: 1,600 Gbps
  over 4 (2D torus); v6e: 3,584 Gbps over 4 — the same cloud.google.com/tpu/docs pages. A group of neighbours along
  one torus axis rings over 2 of them (both directions).
- A100: NVLink 600 GB/s, H100 and H200: 900 GB/s, bidirectional through NVSwitch (the same datasheets): half each
  way, all of it to the group.
- A collective's fixed cost: ``HOP_SECONDS`` a ring step, an estimate (about 1 us a hop on ICI, a few on NVLink in
  public measurements; not a vendor figure).
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
    ici_bandwidth: float = 0.0  # bytes/s one way, all links together
    ici_links: int = 1  # links that bandwidth is spread over
    ring_links: int = 1  # of them, those a ring over one group of neighbours uses
    hop_seconds: float = 1e-6  # a ring step's fixed cost (an estimate, see above)

    @property
    def group_bandwidth(self) -> float:
        """Bytes/s one way a chip moves in a ring over its group."""
        return self.ici_bandwidth * self.ring_links / self.ici_links


CHIPS = {
    "v4": Chip("TPU v4", 32 * GIB, 275e12, 1200e9, 2400e9 / 8, 6, 2),
    "v5e": Chip("TPU v5e", 16 * GIB, 197e12, 819e9, 1600e9 / 8, 4, 2),
    "v5p": Chip("TPU v5p", 95 * GIB, 459e12, 2765e9, 4800e9 / 8, 6, 2),
    "v6e": Chip("TPU v6e", 32 * GIB, 918e12, 1640e9, 3584e9 / 8, 4, 2),
    "a100": Chip("A100 80GB", 80 * GIB, 312e12, 2039e9, 300e9, 1, 1, 3e-6),
    "h100": Chip("H100", 80 * GIB, 989e12, 3350e9, 450e9, 1, 1, 3e-6),
    "h200": Chip("H200", 141 * 10 ** 9, 989e12, 4800e9, 450e9, 1, 1, 3e-6),
}


def collective_seconds(chip: Chip, kind: str, nbytes: float, group: int) -> float:
    """One ring collective over ``group`` chips of ``chip`` moving ``nbytes`` (an all-reduce's operand, an
    all-gather's result, a reduce-scatter's operand): its steps' fixed cost plus its bytes over the group's
    bandwidth. An all-reduce is a reduce-scatter then an all-gather (2 (g - 1) steps of 1 / g of the bytes); an
    all-to-all and a permute send each chip's share once."""
    if group <= 1:
        return 0.0
    steps, share = {"all-reduce": (2 * (group - 1), 2 * (group - 1) / group),
                    "collective-permute": (1, 1.0)}.get(kind, (group - 1, (group - 1) / group))
    return steps * chip.hop_seconds + share * nbytes / chip.group_bandwidth

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
