"""`grpo-jax plan`: a run's programs compiled ahead of time for a topology, from its config alone, and read back.

`plan(config, devices)` builds the run's device programs (`programs.jit_decoder`, `jit_logps`, `jit_train_step`) over
a mesh of ``devices`` (a TPU topology's, `topology_devices`, or the devices at hand) for abstract inputs: nothing
is allocated, no weights or tokenizer are read (`model.path` may hold only config.json). Each phase (prefill, one
decode step, the old/reference log-prob forward, the train step) is compiled once as the run would compile it
(`grpo_jax.api.plan_programs`), for its memory per chip (`memory_analysis`), and its FLOPs and bytes come from XLA's
`cost_analysis` of the same program, corrected for the loops XLA counts once (`plan_programs.costs`); a decode
step's bytes are read from its HLO (`grpo_jax.api.hlo.traffic`). A chip table
(`grpo_jax.device.chips`) turns them into roofline times, and `Plan.fits` says whether every phase's peak is under
`FIT_FRACTION` of HBM.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import math
import os
import re
from typing import NamedTuple

from grpo_jax.api import plan_programs
from grpo_jax.device.chips import GIB, Chip, device_chip, topology_chip
from grpo_jax.config import Config

FIT_FRACTION = 0.9  # a phase fits when its peak is under this share of the chip's HBM (XLA's own buffers, fragments)
PHASES = ("layout", "prefill", "decode_step", "logps", "train_step")
COMPARED = "decode_step_training_layout"  # shown beside the round, not in it
# stated efficiency factors, overridable (`grpo-jax plan --hbm-efficiency --mfu`): the share of HBM bandwidth a
# memory-bound program reaches (tpu-inference's ragged paged attention decodes at ~86 % of it) and of peak FLOP/s a
# compute-bound one does (MaxText's published v5p training MFUs are 50-65 %)
HBM_EFFICIENCY = 0.85
MFU = 0.55


class Phase(NamedTuple):
    """One program of a round, per chip: bytes (XLA's buffer assignment), FLOPs and bytes accessed of one run."""

    name: str
    runs: float  # times one round runs it (decode: steps, an upper bound: every row to max_completion_length)
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    flops: float  # nan: unknown (its loop-free variant did not compile)
    bytes_accessed: float
    error: str | None = None  # XLA refused to compile it: its sizes are what the refusal names (a lower bound)
    collectives: tuple = ()  # `hlo.Collective`s read from its HLO

    def collective_runs(self) -> list:
        """(collective, times it runs in one run of the phase): a decode step's loop body once, the work outside
        its loop spread over the round's steps, known loops (a scan) their trip count times."""
        return [(c, c.trips if (c.per_step or self.name not in ("decode_step", COMPARED)) else c.trips / self.runs)
                for c in self.collectives]

    def collective_bytes(self) -> dict:
        """Bytes per chip of one run, by collective kind."""
        out: dict = {}
        for c, n in self.collective_runs():
            out[c.kind] = out.get(c.kind, 0.0) + c.bytes * n
        return out

    @property
    def peak(self) -> int:
        """Arguments + outputs - donated aliases + temporaries (XLA's buffer assignment)."""
        return self.arguments + self.outputs - self.aliased + self.temporaries


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run's phases on ``chips`` chips of ``chip`` (None: no table entry, e.g. a CPU), judged against
    ``hbm_bytes`` per chip; ``tokens`` the prompt + completion tokens a round trains on."""

    phases: tuple[Phase, ...]
    chip: Chip | None
    hbm_bytes: int
    chips: int
    row_shards: int  # devices the rows split over (mesh.data * fsdp * expert)
    tokens: int
    config: Config
    layout: str = "the training layout"  # where decoding runs and why (`rollout_layout.choose`)
    hbm_efficiency: float = HBM_EFFICIENCY
    mfu: float = MFU
    mean_completion: int = 0  # a row's real completion tokens on average (0: half of max_completion_length)
    decode_row_shards: int = 0  # devices decoding's rows split over in its own layout (0: ``row_shards``)

    def rows_per_chip(self, phase: Phase) -> float:
        """The round's rows a chip holds in ``phase``: decoding's over its own layout's row shards."""
        own = phase.name in ("prefill", "decode_step") and self.decode_row_shards
        return self.config.train.generation_batch_size / (self.decode_row_shards if own else self.row_shards)

    def collective_seconds(self, phase: Phase) -> float:
        """The phase's collectives over the chip's interconnect (`chips.collective_seconds`), one run."""
        from grpo_jax.device.chips import collective_seconds

        if self.chip is None or not self.chip.ici_bandwidth:
            return 0.0
        return sum(n * collective_seconds(self.chip, c.kind, c.bytes, c.group) for c, n in phase.collective_runs())

    def seconds(self, phase: Phase) -> float | None:
        """Estimated time of one run: max(FLOPs / (peak FLOP/s x MFU), bytes / (HBM bandwidth x efficiency)) plus its
        collectives, none overlapped; None without a chip. XLA counts a collective's bytes as memory traffic too."""
        if self.chip is None or math.isnan(phase.flops):
            return None
        return max(phase.flops / (self.chip.bf16_flops * self.mfu),
                   phase.bytes_accessed / (self.chip.hbm_bandwidth * self.hbm_efficiency)) \
            + self.collective_seconds(phase)

    @property
    def round_phases(self) -> tuple[Phase, ...]:
        return tuple(p for p in self.phases if p.name != COMPARED)

    def phase_fits(self, phase: Phase) -> bool:
        return phase.peak < FIT_FRACTION * self.hbm_bytes

    @property
    def fits(self) -> bool:
        return all(self.phase_fits(p) for p in self.round_phases)

    @property
    def round_seconds(self) -> float | None:
        """One round (reshard, sampling, log-probs, its optimizer steps), estimated."""
        times = [self.seconds(p) for p in self.round_phases]
        return None if None in times else sum(p.runs * t for p, t in zip(self.round_phases, times))

    @property
    def tokens_per_second_per_chip(self) -> float | None:
        """A round's rows x (prompt + completion) tokens (every slot, padding included) over its roofline seconds
        and the chips."""
        seconds = self.round_seconds
        return None if seconds is None else self.tokens / seconds / self.chips

    @property
    def mean_completion_length(self) -> int:
        return self.mean_completion or self.config.sampling.max_completion_length // 2

    @property
    def real_tokens_per_second_per_chip(self) -> float | None:
        """A round's rows x (prompt + ``mean_completion_length``) tokens over the same roofline seconds (its decode
        steps still counted to max_completion_length: a lower bound) and the chips."""
        seconds = self.round_seconds
        rows = self.config.train.generation_batch_size
        real = rows * (self.config.data.max_prompt_length + self.mean_completion_length)
        return None if seconds is None else real / seconds / self.chips

    def as_json(self) -> dict:
        """{"fits", "round_seconds", "tokens_per_round", "tokens_per_second_per_chip", "mean_completion_length",
        "real_tokens_per_second_per_chip", "layout", "chip", "phases": {name:
        {"peak_bytes", "hbm_bytes", "flops", "bytes_accessed", "collective_bytes", "collectives", "loop_trips",
        "rows_per_chip", "est_seconds", ...}}}."""
        chip = None if self.chip is None else {**self.chip._asdict(), "hbm_efficiency": self.hbm_efficiency,
                                               "mfu": self.mfu}
        return {"fits": self.fits, "round_seconds": self.round_seconds, "tokens_per_round": self.tokens,
                "tokens_per_second_per_chip": self.tokens_per_second_per_chip,
                "mean_completion_length": self.mean_completion_length,
                "real_tokens_per_second_per_chip": self.real_tokens_per_second_per_chip, "layout": self.layout,
                "chip": chip,
                "phases": {p.name: {
            "peak_bytes": p.peak, "hbm_bytes": self.hbm_bytes, "flops": _known(p.flops),
            "bytes_accessed": _known(p.bytes_accessed), "est_seconds": self.seconds(p), "runs_per_round": p.runs,
            "loop_trips": p.runs, "tokens": self.tokens if p.name in ("logps", "train_step") else None,
            "rows_per_chip": self.rows_per_chip(p),
            "collective_bytes": p.collective_bytes(), "collectives": sum(n for _, n in p.collective_runs()),
            "collective_seconds": self.collective_seconds(p),
            "arguments_bytes": p.arguments, "temporaries_bytes": p.temporaries, "error": p.error}
            for p in self.phases}}


def _known(x: float) -> float | None:
    return None if math.isnan(x) else x


def _tpu_attached() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _accelerator_type(generation: str, chips: int) -> str:
    """The TPU_ACCELERATOR_TYPE of a slice: v5e counts chips as `v5litepod-N`, v6e chips, v4/v5p TensorCores."""
    if generation == "v5e":
        return f"v5litepod-{chips}"
    return f"{generation}-{chips if generation == 'v6e' else 2 * chips}"


def topology_devices(topology: str) -> list:
    """The devices of a TPU topology such as ``v5p:4x4x4`` (libtpu's description: nothing attached is needed), or
    with ``local`` the devices at hand. One-line ValueErrors for a missing libtpu or an unknown topology."""
    import jax

    if topology == "local":
        return list(jax.devices())
    topology_chip(topology)  # the generation, before anything loads
    generation, _, shape = topology.partition(":")
    if not re.fullmatch(r"\d+(x\d+){1,2}", shape):
        raise ValueError(f"--topology {topology!r}: give the slice's shape after the generation, e.g. v5p:4x4x4 or "
                         "v6e:8x8, or --topology local")
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError(f"--topology {topology} compiles for TPUs with libtpu, which is not installed: "
                         "pip install -e '.[tpu]'")
    if not _tpu_attached():  # libtpu would look for a TPU VM's metadata server, a TPU and its lock file
        chips = math.prod(int(n) for n in shape.split("x"))
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", _accelerator_type(generation.lower(), chips))
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as e:  # noqa: BLE001 - libtpu's errors are JaxRuntimeErrors with a status line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--topology {topology!r}: libtpu does not know this slice ({first}); use a supported "
                         "shape, e.g. v5e:2x2, v5p:2x2x1, v5p:4x4x4, v6e:8x8") from None


def local_hbm(device) -> int:
    """Memory a device at hand may use: its allocator's limit, or on a CPU the host's RAM over its devices."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    import jax

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(1, len(jax.local_devices(backend=device.platform)))


def resolved(config: Config) -> Config:
    """``config`` with its architecture from model.path's config.json (weights and tokenizer not needed) and the
    lengths the plan compiles for; one-line ValueErrors naming a key the plan cannot do without."""
    from grpo_jax.config import resolve_defaults
    from grpo_jax.models import peft_io, resolve_config

    config = resolve_defaults(config)
    model = resolve_config(config.model)
    model = dataclasses.replace(model, lora=peft_io.resolve_lora(model.lora))
    if model.vocab_size is None:
        raise ValueError("model.vocab_size=null and no model.path: set model.vocab_size (the plan reads no "
                         "tokenizer), or point model.path at a folder holding config.json")
    if config.data.max_prompt_length is None:
        raise ValueError("data.max_prompt_length=null: the plan reads no data; set data.max_prompt_length to the "
                         "run's prompt length in tokens")
    if config.mesh.rollout:
        raise ValueError(f"mesh.rollout={config.mesh.rollout}: the plan covers colocated runs; set mesh.rollout=0")
    return dataclasses.replace(config, model=model)


def plan(config: Config, devices, *, chip: Chip | None = None, hbm_bytes: int | None = None,
         costs: bool = True, hbm_efficiency: float = HBM_EFFICIENCY, mfu: float = MFU,
         mean_completion: int = 0, decoding: bool = True) -> Plan:
    """The run's phases compiled for ``devices`` (`topology_devices`): memory per chip, FLOPs, bytes, roofline.

    ``chip`` (None: by the devices' kind) gives the roofline's FLOP/s and bandwidth; ``hbm_bytes`` (None: the
    chip's, or a device at hand's limit) what a phase must fit in; ``costs`` False skips FLOPs and bytes (memory
    only: about half the compiles); ``mean_completion`` a row's real completion tokens on average for the real
    tokens/s (0: half of max_completion_length); ``decoding`` False plans the log-prob and train phases alone (what
    a change to the update needs; the round's totals are then not a round's)."""
    from grpo_jax.device import sharding

    config = resolved(config)
    if decoding and config.sampling.num_beams > 1:  # its decode program is `beam.generate`, which plan_programs skips
        raise ValueError(f"sampling.num_beams={config.sampling.num_beams}: grpo-jax plan models sampling without beams "
                         "(a beam search holds rows x num_beams KV caches); plan with sampling.num_beams=1 and "
                         "scale the decode cache by num_beams")
    devices = list(devices)
    tpu = devices[0].platform == "tpu"
    chip = chip or device_chip(devices[0].device_kind)
    if hbm_bytes is None:
        hbm_bytes = chip.hbm_bytes if (chip is not None and tpu) else local_hbm(devices[0])
    m = config.mesh
    mesh = sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=devices, expert=m.expert)
    phases, layout, decode_shards = _phases(config, mesh, tpu, costs, chip, decoding)
    tc = config.train
    tokens = tc.generation_batch_size * (config.data.max_prompt_length + config.sampling.max_completion_length)
    return Plan(tuple(phases), chip, hbm_bytes, len(devices), sharding.num_row_shards(mesh), tokens, config,
                layout, hbm_efficiency, mfu, mean_completion, decode_shards)


def hint(plan_: Plan, phase: Phase) -> str:
    """One line: what would make ``phase`` fit."""
    c = plan_.config
    tc, mesh, model = c.train, c.mesh, c.model
    shards = mesh.fsdp if mesh.fsdp > 0 else plan_.chips
    need = f"{phase.name} needs {'at least ' if phase.error else ''}{_size(phase.peak)} per chip of " \
           f"{_size(plan_.hbm_bytes)}"
    if phase.arguments > 0.5 * plan_.hbm_bytes:
        if shards < plan_.chips:
            return f"{need}, {_size(phase.arguments)} of it the state: raise mesh.fsdp (now {mesh.fsdp})"
        if not model.lora.enabled:
            return f"{need}, {_size(phase.arguments)} of it the state: train LoRA adapters (model.lora.rank=16)"
    if phase.name == "train_step" and model.remat == "none":
        return f"{need}: set model.remat=full (each layer's activations recomputed in the backward)"
    if phase.name in ("train_step", "logps") and tc.logps_chunk_size != 1:
        return f"{need}: set train.logps_chunk_size=1 (one row's [T, vocab] logits at a time)"
    rows = tc.train_batch_size // tc.gradient_accumulation_steps // plan_.row_shards
    if phase.name == "train_step" and rows > 1:
        return (f"{need}: raise train.gradient_accumulation_steps (now {tc.gradient_accumulation_steps}; {rows} rows "
                "per chip per micro-batch)")
    rows = tc.generation_batch_size // plan_.row_shards
    if phase.name == "logps" and rows > 1:
        return (f"{need}: lower train.train_batch_size * train.steps_per_generation (the log-prob pass runs the "
                f"round's {rows} rows per chip at once)")
    slots = c.sampling.max_batch_rows or tc.generation_batch_size
    if phase.name in ("prefill", "decode_step") and slots > plan_.row_shards:
        return f"{need}: lower sampling.max_batch_rows (decode slots, each with a cache of prompt + completion)"
    # attention through a kernel (auto on a listed chip: splash or cuDNN) keeps its memory linear in the sequence
    if c.model.attention == "dense" or (c.model.attention == "auto" and plan_.chip is None):
        return (f"{need}, {_size(phase.temporaries)} of it temporaries: lower sampling.max_completion_length or "
                "data.max_prompt_length (dense attention's [rows, heads, L, L] scores grow with the square of the "
                "sequence), or use more chips")
    return (f"{need}, {_size(phase.temporaries)} of it temporaries (activations and logits): lower "
            "sampling.max_completion_length or data.max_prompt_length, or use more chips")


def _size(n: float) -> str:
    if math.isnan(n):
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


def report(plan_: Plan, topology: str) -> list[str]:
    """The plan as printable lines: a table of phases, the round's estimate, whether it fits, and the hints."""
    c = plan_.config
    chip = plan_.chip.name if plan_.chip else "no chip table entry (no roofline)"
    lines = [f"grpo-jax plan: {topology}, {plan_.chips} chips ({chip}), HBM {_size(plan_.hbm_bytes)} per "
             f"chip; {c.train.generation_batch_size} rows a round x ({c.data.max_prompt_length} prompt + "
             f"{c.sampling.max_completion_length} completion) tokens; decoding in {plan_.layout}",
             f"{'phase':<12} {'runs/round':>10} {'arguments':>10} {'temporaries':>11} {'peak':>10} {'of HBM':>7} "
             f"{'FLOPs':>9} {'bytes':>10} {'coll.':>6} {'coll. bytes':>11} {'ICI s':>9} {'est. s':>9}"]
    for p in plan_.phases:
        t = plan_.seconds(p)
        if p.error:
            lines.append(f"{p.name:<12} {p.runs:>10g} refused by XLA, needs at least {_size(p.peak)}: {p.error}")
            continue
        flops = "-" if math.isnan(p.flops) else f"{p.flops:.3g}"
        runs = p.collective_runs()
        lines.append(f"{p.name:<12} {p.runs:>10g} {_size(p.arguments):>10} {_size(p.temporaries):>11} "
                     f"{_size(p.peak):>10} {p.peak / plan_.hbm_bytes:>7.0%} {flops:>9} "
                     f"{_size(p.bytes_accessed):>10} {sum(n for _, n in runs):>6.0f} "
                     f"{_size(sum(p.collective_bytes().values())):>11} {plan_.collective_seconds(p):>9.3g} "
                     f"{'-' if t is None else f'{t:.3g}':>9}")
    seconds = plan_.round_seconds
    if seconds is not None:
        lines.append(f"round: {seconds:.2f} s estimated at {plan_.hbm_efficiency:.0%} of HBM bandwidth, "
                     f"{plan_.mfu:.0%} MFU, collectives over ICI not overlapped (decode steps counted to "
                     "max_completion_length), "
                     f"{plan_.tokens_per_second_per_chip:,.0f} tokens/s/chip (a round's "
                     f"{c.train.generation_batch_size} rows x "
                     f"{c.data.max_prompt_length + c.sampling.max_completion_length} prompt + completion slots), "
                     f"{plan_.real_tokens_per_second_per_chip:,.0f} real at a mean completion of "
                     f"{plan_.mean_completion_length} tokens (--mean-completion)")
    if plan_.fits:
        lines.append(f"fits: every phase's peak is under {FIT_FRACTION:.0%} of HBM")
    else:
        lines.append(f"does not fit (a phase's peak over {FIT_FRACTION:.0%} of HBM):")
        lines += [hint(plan_, p) for p in plan_.round_phases if not plan_.phase_fits(p)]
    return lines


def _phases(config: Config, mesh, tpu: bool, with_costs: bool, chip: Chip | None,
            decoding: bool = True) -> tuple[list[Phase], str, int]:
    """The run's phases over ``mesh``: memory from the programs as the run compiles them, FLOPs and bytes from the
    same programs (`plan_programs.costs`), their collectives from their HLO (`hlo.collectives`); the decoding
    layout's reason and its row shards (0: the training layout's)."""
    from grpo_jax.api import hlo
    from grpo_jax.algo.state import abstract_state, optimizer_from_config
    from grpo_jax.device import sharding

    tc = config.train
    compiled = plan_programs.programs(config, mesh, config.model, tpu=tpu, chip=chip, compare_layouts=True,
                                      decoding=decoding)
    costs = (plan_programs.costs(config, mesh, compiled, tpu=tpu, chip=chip) if with_costs
             else {name: (math.nan, math.nan) for name in compiled})
    steps = plan_programs.decode_steps(config)
    runs = {"layout": 1, "prefill": 1, "decode_step": steps, COMPARED: steps,
            "logps": int(tc.needs_old_logps) + int(config.loss.beta != 0.0), "train_step": tc.steps_per_round}
    phases = []
    for name, program in compiled.items():
        c = program.compiled
        if isinstance(c, plan_programs.Refused):
            phases.append(Phase(name, runs[name], 0, 0, 0, c.needs, *costs[name], error=c.message))
            continue
        m = c.memory_analysis()
        phases.append(Phase(name, runs[name], m.argument_size_in_bytes, m.output_size_in_bytes,
                            m.alias_size_in_bytes, m.temp_size_in_bytes, *costs[name],
                            collectives=tuple(hlo.collectives(c.as_text(), mesh.devices.size))))
    _, optimizer = optimizer_from_config(tc, config.max_steps)
    shapes = abstract_state(config.model, optimizer, with_reference=config.loss.beta != 0.0,
                            ref_param_dtype=tc.ref_param_dtype)
    layout = plan_programs.decode_layout(config, mesh, config.model, chip, shapes,
                                         sharding.state_shardings(mesh, shapes, offload_ref=tc.offload_ref_params))
    if layout is None:
        return phases, "the training layout", 0
    from grpo_jax.device import rollout_layout
    return phases, layout.reason, sharding.num_row_shards(rollout_layout.rollout_mesh(mesh, layout))
