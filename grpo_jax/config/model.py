"""`ModelConfig`: a decoder's architecture (Hugging Face ``config.json`` names) and its numerics (dtypes,
remat, how the layers run), validated on construction with messages that name the field and the fix."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from grpo_jax.config.sections import check

# numpy dtypes, which jax takes as they are (jnp.bfloat16 is ml_dtypes.bfloat16): the schema needs no jax
_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
MODEL_TYPES = ("qwen2", "llama", "qwen3", "mistral", "gemma2", "gemma3_text", "qwen3_moe", "cohere2", "gpt_oss",
               "glm4_moe")
MOE_TYPES = ("qwen3_moe", "gpt_oss", "glm4_moe")  # the model types whose MLPs are mixtures of experts
LAYER_TYPES = ("full_attention", "sliding_attention")  # per-layer attention kinds, transformers' names
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP's hidden_act (transformers' names)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# `models.attention`: auto resolves by jax's backend (TPU splash, GPU cudnn, CPU dense); splash_interpret runs the
# splash kernel in Pallas interpret mode (any backend, slow: tests)
ATTENTION = ("auto", "dense", "splash", "cudnn", "xla", "splash_interpret")
REMAT = ("none", "full", "dots")  # `models.transformer.REMAT_POLICIES`: what a layer's backward keeps
# parameters no gradient moves, kept in the state to load and export them (transformers' buffers): GLM-4-MoE's
# router correction bias, which DeepSeek-V3's balancing adjusts outside the gradient (`families.without_buffers`)
BUFFERS = ("e_score_correction_bias",)
# the decoder's linear layers by PEFT's names; "all-linear" targets all of them (never lm_head, as in PEFT)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters on the decoder's linear layers (PEFT's ``LoraConfig`` names): y = x W + (alpha / r) (x A) B.

    ``rank`` 0 and no ``path``: no adapters (full fine-tuning). ``path``: a PEFT adapter folder whose
    ``adapter_config.json`` and tensors give rank, alpha and targets (`models.peft_io.resolve_lora`)."""

    rank: int = 0  # PEFT's r; 0: full fine-tuning
    alpha: float = 8.0  # PEFT's lora_alpha: the update is scaled by alpha / rank
    dropout: float = 0.0  # PEFT's lora_dropout: on the adapters' input in the update's forward (`models.lora`)
    target_modules: tuple[str, ...] | str = "all-linear"
    use_rslora: bool = False  # scale by alpha / sqrt(rank) (rank-stabilised LoRA)
    init_lora_weights: bool | str = True  # true: A Kaiming-uniform; gaussian: A ~ N(0, 1/r); B zero. false: B too
    path: str | None = None  # a PEFT adapter folder to start from (needs model.path, its base)

    def __post_init__(self):
        check(isinstance(self.rank, int) and self.rank >= 0,
              f"model.lora.rank={self.rank!r} must be an integer >= 0 (0: no adapters)")
        check(self.alpha > 0, f"model.lora.alpha={self.alpha} must be > 0")
        check(0.0 <= self.dropout < 1.0, f"model.lora.dropout={self.dropout} must be in [0, 1) (PEFT's lora_dropout)")
        names = (self.target_modules,) if isinstance(self.target_modules, str) else self.target_modules
        check(names == ("all-linear",) or (len(names) >= 1 and set(names) <= set(LORA_TARGETS)),
              f"model.lora.target_modules={self.target_modules!r}: use all-linear or a list of "
              f"{', '.join(LORA_TARGETS)}")
        check(self.init_lora_weights in (True, False, "gaussian"),
              f"model.lora.init_lora_weights={self.init_lora_weights!r}: use true (A Kaiming-uniform), gaussian "
              "(A normal with std 1/rank) or false (B random too: the adapters change the model at step 0)")

    @property
    def enabled(self) -> bool:
        """The model carries adapters: a rank, or a PEFT folder that gives one."""
        return self.rank > 0 or self.path is not None

    @property
    def targets(self) -> tuple[str, ...]:
        """The adapted layers' names, in `LORA_TARGETS` order."""
        names = (self.target_modules,) if isinstance(self.target_modules, str) else self.target_modules
        return LORA_TARGETS if names == ("all-linear",) else tuple(n for n in LORA_TARGETS if n in names)

    @property
    def scale(self) -> float:
        """PEFT's ``scaling``: alpha / rank, or alpha / sqrt(rank) with ``use_rslora``."""
        return self.alpha / (self.rank ** 0.5 if self.use_rslora else self.rank)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters; names follow Hugging Face ``config.json`` where it has one."""

    vocab_size: int | None = None  # None: the tokenizer's size (the trainer fills it in)
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rope_theta: float = 100.0  # a random model's (the default run's short rows); model.path's config.json sets its own
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    max_position_embeddings: int = 2048
    dtype: str = "float32"  # compute dtype
    initializer_range: float = 0.02
    model_type: str = "qwen2"
    attention_out_bias: bool = False  # o_proj bias (Llama's attention_bias sets both)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm of q and k over the head dim before RoPE
    sliding_window: int | None = None  # a key is visible when query_slot - key_slot < sliding_window
    # per layer full_attention / sliding_attention (the window on sliding layers only); None: every layer sliding
    # when sliding_window is set, else full
    layer_types: tuple[str, ...] | None = None
    rope_local_base_freq: float | None = None  # Gemma 3: sliding layers' RoPE theta (default RoPE); None: as full
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU, Gemma)
    query_pre_attn_scalar: int | None = None  # scores scaled by its -1/2 power (Gemma); None: head_dim
    attn_logit_softcapping: float | None = None  # scores -> c * tanh(scores / c) (Gemma 2); None: off
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2); None: off
    logit_scale: float | None = None  # logits multiplied by it (Cohere 2's logit_scale); None: unscaled
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int | None = None
    # yarn (GPT-OSS; transformers' names without rope_): frequencies ramped between beta_fast and beta_slow
    # rotations, the correction range rounded outwards with rope_truncate, cos/sin scaled by rope_attention_factor
    # (None: 0.1 ln(rope_factor) + 1)
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float | None = None
    attention_sinks: bool = False  # a learned logit per query head joins every softmax (GPT-OSS's sinks)
    param_dtype: str = "float32"  # storage dtype
    remat: str = "none"
    attention: str = "auto"  # the attention backend, one of ATTENTION (`models.attention.resolve`)
    # training/scoring forward: false runs the layers as a Python loop (each layer's residuals its own buffer);
    # true as one lax.scan, whose compile time does not grow with depth but which stacks residuals into [L, ...]
    scan_layers: bool = False
    scan_unroll: int = 2  # with scan_layers: decoder layers per scan iteration
    path: str | None = None  # a local Hugging Face model folder; its config.json gives the architecture
    init: str | None = None  # random: random weights of the sizes above, on any data; None: model.path's (see check)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)  # adapters trained on the frozen model
    # mixture of experts (Qwen3-MoE, models/moe.py): every decoder layer's MLP is num_experts SwiGLU experts of
    # width moe_intermediate_size, num_experts_per_tok of them per token; 0 experts: dense MLPs
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False  # renormalise the chosen experts' router probabilities to sum 1
    router_aux_loss_coef: float = 0.001  # the architecture's load-balancing coefficient (HF config.json)
    # GPT-OSS's experts: (up + 1) * g * sigmoid(swiglu_alpha * g), g = min(gate, limit), up clipped to +-limit
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # routing replay: the sampler records each token's experts and the log-prob forwards (old, reference, the
    # update) use them instead of routing afresh
    routing_replay: bool = False
    # GLM-4-MoE (transformers' names): the first first_k_dense_replace layers have a dense MLP (intermediate_size),
    # the others experts chosen by sigmoid scores plus a correction bias, in topk_group of n_group groups, their
    # weights times routed_scaling_factor, beside n_shared_experts always-on experts; RoPE on the first
    # partial_rotary_factor of each head
    first_k_dense_replace: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        names = ("vocab_size",) if self.vocab_size is not None else ()
        for name in (*names, "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, f"model.{name}={value!r} must be a positive integer")
        check(self.num_attention_heads % self.num_key_value_heads == 0,
               f"model.num_attention_heads={self.num_attention_heads} is not a multiple of "
               f"model.num_key_value_heads={self.num_key_value_heads}: choose a divisor for the kv heads")
        check(self.head_dim is not None or self.hidden_size % self.num_attention_heads == 0,
               f"model.hidden_size={self.hidden_size} is not a multiple of model.num_attention_heads="
               f"{self.num_attention_heads}: set model.head_dim explicitly or change the head count")
        check(self.head_dim is None or (isinstance(self.head_dim, int) and self.head_dim >= 1),
               f"model.head_dim={self.head_dim!r} must be a positive integer or None")
        check(self.resolved_head_dim % 2 == 0,
               f"model.head_dim={self.resolved_head_dim} must be even for rotary embeddings")
        for name in ("dtype", "param_dtype"):
            check(getattr(self, name) in _DTYPES,
                   f"model.{name}={getattr(self, name)!r} is not supported: use one of {sorted(_DTYPES)}")
        check(self.rope_theta > 0, f"model.rope_theta={self.rope_theta} must be > 0")
        check(self.rms_norm_eps > 0, f"model.rms_norm_eps={self.rms_norm_eps} must be > 0")
        check(self.initializer_range > 0, f"model.initializer_range={self.initializer_range} must be > 0")
        check(self.model_type in MODEL_TYPES,
               f"model.model_type={self.model_type!r} is not supported: use one of {', '.join(MODEL_TYPES)}")
        check(isinstance(self.scan_unroll, int) and self.scan_unroll >= 1,
               f"model.scan_unroll={self.scan_unroll!r} must be an integer >= 1 (layers per scan iteration)")
        check(self.attention in ATTENTION, f"model.attention={self.attention!r} is not supported: use one of "
              f"{', '.join(ATTENTION)} (auto: splash on TPU, cudnn on GPU, dense on CPU)")
        check(self.remat in REMAT,
               f"model.remat={self.remat!r} is not supported: use one of {', '.join(REMAT)}")
        check(self.sliding_window is None or (isinstance(self.sliding_window, int) and self.sliding_window >= 1),
               f"model.sliding_window={self.sliding_window!r} must be a positive integer, or null for full "
               "attention")
        self._check_layers()
        check(self.init in (None, "random"), f"model.init={self.init!r}: use random (random weights of the model.* "
              "sizes), or null (model.path's weights; a random model only for the embedded tasks)")
        check(self.init is None or self.path is None, f"model.init=random with model.path={self.path!r}: the weights "
              "would come from one and be ignored by the other; unset one of them")
        self._check_rope()
        self._check_moe()
        self._check_glm()

    def _check_moe(self):
        check(isinstance(self.num_experts, int) and self.num_experts >= 0,
              f"model.num_experts={self.num_experts!r} must be an integer >= 0 (0: dense MLPs)")
        check((self.num_experts > 0) == (self.model_type in MOE_TYPES),
              f"model.num_experts={self.num_experts} with model.model_type={self.model_type!r}: mixture-of-experts "
              f"models are {' and '.join(MOE_TYPES)} (num_experts >= 1); every other model_type has dense MLPs "
              "(num_experts=0)")
        if self.num_experts:
            check(isinstance(self.num_experts_per_tok, int) and 1 <= self.num_experts_per_tok <= self.num_experts,
                  f"model.num_experts_per_tok={self.num_experts_per_tok!r} must be in 1 .. model.num_experts="
                  f"{self.num_experts}")
            check(isinstance(self.moe_intermediate_size, int) and self.moe_intermediate_size >= 1,
                  f"model.moe_intermediate_size={self.moe_intermediate_size!r} must be a positive integer")
        check(not (self.num_experts and self.lora.enabled and set(self.lora.targets) & {"gate_proj", "up_proj",
                                                                                        "down_proj"}
                   and self.lora.target_modules != "all-linear"),
              f"model.lora.target_modules={self.lora.target_modules!r}: LoRA on a mixture of experts' experts is not "
              "supported; target the attention (q_proj, k_proj, v_proj, o_proj) or all-linear, which is them")
        check(self.router_aux_loss_coef >= 0, f"model.router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0")
        # with a path the architecture is config.json's: `run.build` checks it once resolved
        check(not self.routing_replay or self.num_experts > 0 or self.path is not None,
              f"model.routing_replay=true needs a mixture-of-experts model (model_type "
              f"{' or '.join(MOE_TYPES)}): set it to false")

    def _check_glm(self):
        defaults = {"first_k_dense_replace": 0, "n_shared_experts": 0, "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 1.0, "partial_rotary_factor": 1.0}
        if self.model_type != "glm4_moe":
            for name, default in defaults.items():
                check(getattr(self, name) == default, f"model.{name}={getattr(self, name)!r} is a GLM-4-MoE option: "
                      f"set it to {default} or model_type=glm4_moe")
            return
        L, E = self.num_hidden_layers, self.num_experts
        check(isinstance(self.first_k_dense_replace, int) and 0 <= self.first_k_dense_replace < L,
              f"model.first_k_dense_replace={self.first_k_dense_replace!r} must be in 0 .. num_hidden_layers - 1 = "
              f"{L - 1} (the dense layers before the routed ones)")
        check(isinstance(self.n_shared_experts, int) and self.n_shared_experts >= 0,
              f"model.n_shared_experts={self.n_shared_experts!r} must be an integer >= 0")
        check(isinstance(self.n_group, int) and self.n_group >= 1 and E % self.n_group == 0
              and E // self.n_group >= 2, f"model.n_group={self.n_group!r} must divide model.num_experts={E} into "
              "groups of at least 2 (a group scores its best two)")
        check(isinstance(self.topk_group, int) and 1 <= self.topk_group <= self.n_group
              and self.num_experts_per_tok <= self.topk_group * (E // self.n_group),
              f"model.topk_group={self.topk_group!r} must be in 1 .. n_group={self.n_group}, its groups holding the "
              f"num_experts_per_tok={self.num_experts_per_tok} experts")
        check(self.routed_scaling_factor > 0, f"model.routed_scaling_factor={self.routed_scaling_factor} must be > 0")
        check(0 < self.partial_rotary_factor <= 1 and self.rotary_dim >= 1,
              f"model.partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and turn at least one of "
              f"the head's {self.resolved_head_dim} dims")
        check(self.router_aux_loss_coef == 0, f"model.router_aux_loss_coef={self.router_aux_loss_coef}: GLM-4-MoE's "
              "sigmoid router has no softmax load-balancing loss; set it to 0")

    @property
    def routed_layers(self) -> int:
        """The layers whose MLP is a mixture of experts: all but GLM-4-MoE's first dense ones (0: a dense model)."""
        return self.num_hidden_layers - self.first_k_dense_replace if self.num_experts else 0

    @property
    def rotary_dim(self) -> int:
        """transformers' RoPE ``dim``: the first ``partial_rotary_factor`` of the head (GLM-4-MoE: half). Its
        frequencies are arange(0, dim, 2) / dim, so an odd dim turns dim + 1 dims, as transformers does."""
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    def _check_layers(self):
        types = self.layer_types
        check(types is None or (isinstance(types, tuple) and len(types) == self.num_hidden_layers
                                and set(types) <= set(LAYER_TYPES)),
              f"model.layer_types={types!r}: give one of {', '.join(LAYER_TYPES)} per layer "
              f"({self.num_hidden_layers}), or null")
        check(types is None or "sliding_attention" not in types or self.sliding_window is not None,
              "model.layer_types has sliding_attention layers but model.sliding_window is null: set the window")
        check(self.hidden_act in ACTIVATIONS,
              f"model.hidden_act={self.hidden_act!r} is not supported: use one of {', '.join(ACTIVATIONS)}")
        for name in ("rope_local_base_freq", "query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping", "logit_scale"):
            value = getattr(self, name)
            check(value is None or value > 0, f"model.{name}={value!r} must be > 0, or null")

    def _check_rope(self):
        check(self.rope_type in ROPE_TYPES,
               f"model.rope_type={self.rope_type!r} is not supported: use one of {', '.join(ROPE_TYPES)}")
        if self.rope_type == "default":
            check(self.rope_factor == 1.0, f"model.rope_factor={self.rope_factor} has no effect with "
                   "model.rope_type='default': set rope_type to linear, llama3 or yarn, or the factor to 1.0")
            return
        check(self.rope_factor >= 1.0, f"model.rope_factor={self.rope_factor} must be >= 1 for "
               f"model.rope_type={self.rope_type!r}")
        if self.rope_type in ("llama3", "yarn"):
            original = self.rope_original_max_position_embeddings
            check(isinstance(original, int) and original >= 1,
                   f"model.rope_original_max_position_embeddings={original!r} must be a positive integer with "
                   f"model.rope_type={self.rope_type!r} (8192 for Llama 3.1, 4096 for GPT-OSS)")
        if self.rope_type == "yarn":
            check(self.rope_beta_fast > self.rope_beta_slow > 0,
                  f"model.rope_beta_fast={self.rope_beta_fast}, model.rope_beta_slow={self.rope_beta_slow}: need "
                  "beta_fast > beta_slow > 0 (YaRN's 32 and 1)")
            check(self.rope_attention_factor is None or self.rope_attention_factor > 0,
                  f"model.rope_attention_factor={self.rope_attention_factor!r} must be > 0, or null (0.1 ln(factor) "
                  "+ 1)")
        if self.rope_type == "llama3":
            check(0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
                   f"model.rope_low_freq_factor={self.rope_low_freq_factor}, model.rope_high_freq_factor="
                   f"{self.rope_high_freq_factor}: need 0 < low_freq_factor < high_freq_factor (Llama 3.1: 1, 4)")

    @property
    def resolved_head_dim(self) -> int:
        """Head dimension: ``head_dim`` or ``hidden_size // num_attention_heads``."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def resolved_layer_types(self) -> tuple[str, ...]:
        """Each layer's attention kind: ``layer_types``, else every layer sliding_attention with a window and
        full_attention without."""
        if self.layer_types is not None:
            return tuple(self.layer_types)
        return (LAYER_TYPES[self.sliding_window is not None],) * self.num_hidden_layers

    @property
    def jnp_dtype(self):
        """The compute dtype (activations, KV cache, logits) as a numpy dtype (jax takes it as it is)."""
        return _DTYPES[self.dtype]

    @property
    def param_jnp_dtype(self):
        """The parameter storage dtype as a numpy dtype."""
        return _DTYPES[self.param_dtype]
