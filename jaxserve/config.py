"""The model configuration: one frozen dataclass for every supported Llama-family model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from jaxserve import config_fields as fields
from jaxserve.config_falcon_h1 import FalconScales
from jaxserve.config_families import BIASED_NORM_FAMILIES, QKV_BIAS_FAMILIES, UNGATED_MLP_FAMILIES, Family
from jaxserve.config_gemma4 import Gemma4Layers, check_gemma4, full_attention_config
from jaxserve.config_granite_swa import GRANITE_SWA_FAMILIES
from jaxserve.config_mamba import MambaConfig
from jaxserve.config_mla import MLA_FAMILIES, check_mla, mla_softmax_scale
from jaxserve.config_qwen3_next import GATED_DELTA_FAMILIES
from jaxserve.errors import UnsupportedModelError
from jaxserve.models.quantized import check_method
from jaxserve.rope import RopeScaling, rope_inv_freq_and_scale  # noqa: F401 (also importable from here)

# A config's model_type: each family's own name, and a few others.
_HF_MODEL_TYPES: dict[str, Family] = {**{f: f for f in get_args(Family)}, "gemma3_text": "gemma3", "gemma4_text": "gemma4",
                                      "phi3": "mistral", "llama4_text": "llama4"}
GRANITE_MOE_FAMILIES: tuple[str, ...] = ("granitemoe", "granitemoeshared", "granitemoehybrid",
                                          "granitemoe_swa")  # experts fused
GRANITE_SHARED_FAMILIES = fields.GRANITE_SHARED_FAMILIES
MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", *GRANITE_MOE_FAMILIES, "glm4_moe", "ernie4_5_moe",
                                  "dots1", "gpt_oss", "olmoe", "nemotron_h", "lfm2", "minimax_m2", "llama4", "hunyuan_v1_moe", "exaone_moe",
                                  "afmoe", "flex_olmo", "mimo_v2_flash", "cohere2_moe", "jamba",
                                  *MLA_FAMILIES, *GATED_DELTA_FAMILIES)
GRANITE_FAMILIES: tuple[str, ...] = ("granite", *GRANITE_MOE_FAMILIES, "granite_swa")
GLM_FAMILIES: tuple[str, ...] = ("glm", "glm4")  # rotary pairs interleaved (half-split at load), q/k/v biases
ERNIE_FAMILIES: tuple[str, ...] = ("ernie4_5", "ernie4_5_moe")
COHERE_FAMILIES: tuple[str, ...] = ("cohere", "cohere2", "cohere2_moe")
"""LayerNorm (no bias) in place of RMSNorm; attention and the MLP read the same normed input, their outputs added."""
INTERLEAVED_ROPE_FAMILIES = (*GLM_FAMILIES, *ERNIE_FAMILIES, *COHERE_FAMILIES, "llama4", "helium", "gptj")
"""Rotary pairs interleaved (dims 2i and 2i + 1 turn together): q and k rows are read into the half-split order."""
GEMMA_FAMILIES: tuple[str, ...] = ("gemma", "gemma2", "gemma3", "gemma4")
"""Embeddings scaled by sqrt(hidden_size); after Gemma (1), norms after attention and the MLP too (`output_norms`)."""
UNIT_NORM_FAMILIES: tuple[str, ...] = ("gemma", "gemma2", "gemma3", "nemotron", *GATED_DELTA_FAMILIES)  # (1 + w)
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
OLMO_FAMILIES: tuple[str, ...] = ("olmo2", "olmo3", "flex_olmo", "olmo_hybrid")
POST_NORM_FAMILIES: tuple[str, ...] = ("olmo2", "olmo3", "flex_olmo", "exaone4")  # (OLMo Hybrid's by layer kind)
"""Norms after attention and the MLP (on their outputs), none before them."""

@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder; jit treats it as static (hashable)."""

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    clip_qkv: float | None = None  # q, k and v clamped to [-clip_qkv, clip_qkv] after their projections (OLMo)
    parallel_residual: bool | None = None  # `use_parallel_residual` (GPT-NeoX's false, StableLM's true); None: family's
    parallel_norms: int = 1  # a parallel block's norms: 1, shared (Cohere's, Phi's), or 2, the MLP's own (GPT-NeoX's)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # per layer, "sliding_attention" or "full_attention"; None: all alike
    hidden_act: str = "silu"
    attn_logit_softcap: float | None = None  # cap * tanh(logit / cap) on attention logits (Gemma 2)
    final_logit_softcap: float | None = None  # ... and on the vocabulary logits
    query_pre_attn_scalar: float | None = None  # the attention scale is its -1/2 power (default: head_dim's)
    # Granite's scalars: embeddings times `embedding_multiplier`, the attention scale `attention_multiplier` itself,
    # each block's output times `residual_multiplier` before its residual add, the logits over `logits_scaling`.
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    rope_local_theta: float | None = None  # the sliding layers' own unscaled rotary base (Gemma 3)
    rotary_dim: int | None = None  # rotated leading dims of each head (partial rotary: Phi-4-mini); None: all
    # Mixture of experts (0 experts = a dense MLP): top-k routing over `num_experts` MLPs of width `moe_intermediate_size`;
    # `norm_topk_prob` renormalizes the k weights; a shared expert (0 wide: none) sees every token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    # DeepSeek-V3's routing (GLM-4.5), `router_scoring` "sigmoid": experts chosen by sigmoid score plus a bias each
    # (`router_bias`: `LayerParams.router_bias`) among the `expert_topk_groups` best of `expert_groups` groups, weighted
    # by their scores (renormalized: `norm_topk_prob`) times `routed_scaling_factor`. ERNIE 4.5's: softmax, the bias.
    router_scoring: Literal["softmax", "sigmoid"] = "softmax"
    router_bias: bool = False
    expert_groups: int = 1
    expert_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_scale: float = 1.0  # the shared experts' output times this (Command A MoE's "average": 0.5)
    first_dense_layers: int = 0  # the first layers' MLP is dense, `intermediate_size` wide (`Params.dense_layers`)
    moe_layer_step: int = 1  # Llama 4 Maverick's: only every `moe_layer_step`-th layer has experts, the others dense
    # gpt-oss's experts: biased, and a clamped SwiGLU, (min(up, limit) clipped both ways + 1) * g * sigmoid(alpha * g)
    # for g = min(gate, limit); None: SiLU(gate) * up.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Per-layer `k_scale` / `v_scale` tensors for a float8 KV cache (a compressed-tensors `kv_cache_scheme`).
    kv_cache_scales: bool = False
    mrope_section: tuple[int, ...] | None = None
    """Multimodal rotary embedding (Qwen-VL): how many rotary pairs turn by each token's temporal, height and width
    position (`ModelInputs.rope_offsets`), in order or, `mrope_interleaved` (Qwen3-VL), in turn; None: by position."""
    mrope_interleaved: bool = False
    deepstack_layers: int = 0  # Qwen3-VL: the first layers add the image tokens' deepstack embeddings (`llama.forward`)
    no_rope_layers: tuple[int, ...] | None = None
    """SmolLM3, Granite 4.0: per layer, 1 where queries and keys are rotated by position, 0 where not (NoPE); None: all."""
    alibi_slopes: tuple[float, ...] | None = None  # ALiBi (BLOOM, Falcon-RW, MPT): a slope a query head
    weight_quant: str | None = None  # projections kept quantized in memory (`models.quantized.METHODS`)
    # Ministral 3: queries times 1 + beta * log(1 + floor(position / length)); 0: none (Llama 4's temperature tuning:
    # its unrotated layers' queries only, by 1 + beta * log(1 + floor((position + 1) / length)))
    query_scale_beta: float = 0.0
    query_scale_length: int = 0
    attention_chunk: int | None = None  # Llama 4: "chunked_attention" layers see their chunk of positions only
    rope_qk_norm: bool = False  # rotated layers' q and k normed after the rotation (Hunyuan), with no weight (Llama 4)
    moe_latent_size: int = 0  # the experts' width in and out, projected to and from (Nemotron 3 Super); 0: hidden_size
    # MiMo-V2-Flash: values `attention_value_dim` wide (0: head_dim; held padded with zeros to head_dim), attention's
    # output times `attention_value_scale`.
    attention_value_dim: int = 0
    attention_value_scale: float = 1.0
    moe_runner: str = "auto"  # the experts' matmuls (`models.moe.moe_mlp`): auto (by the attention backend), xla, pallas
    # Multi-head latent attention (DeepSeek; 0: none): one latent of `kv_lora_rank` dims and one rotary key per
    # token; queries through a `q_lora_rank` bottleneck (0: none); values of `v_head_dim` dims (`config_mla`).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    v_head_dim: int = 0
    # DeepSeek Sparse Attention (`config_mla.DSA_FAMILIES`; 0: none): an indexer of `index_heads` heads of
    # `index_head_dim` dims picks the `index_topk` keys each token's MLA attends.
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_shared_layers: tuple[int, ...] = ()  # GLM-5.2's: layers that reuse the last indexer layer's choice
    mamba: MambaConfig | None = None  # a hybrid model's Mamba-2 layers (Granite 4.0-H; `config_mamba`); None: none
    falcon: FalconScales | None = None  # Falcon-H1's multipliers (folded into its weights at load)
    gemma4: Gemma4Layers | None = None  # Gemma 4's full-attention layers' own head width, KV heads, rotary, k = v

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend and hold pages: all but a hybrid's Mamba and MLP-only layers (Falcon-H1's: all)."""
        m = self.mamba
        if self.gemma4 is not None:  # (its last layers that attend over an earlier one's pages hold none)
            return tuple(range(self.num_layers - self.gemma4.shared_layers))
        return tuple(i for i in range(self.num_layers) if m is None or m.parallel or i not in m.layers
                     and i not in m.no_mixer)

    @property
    def rotary_dims(self) -> int:
        """How many leading dims of each head the rotary embedding turns (the rest pass through)."""
        return self.rotary_dim or self.head_dim

    @property
    def image_width(self) -> int:
        """An image token's embeddings (`ModelInputs.image_embeds`): hidden_size times 1 + its deepstack layers."""
        return self.hidden_size * (1 + self.deepstack_layers)

    @property
    def long_rope_context(self) -> int | None:
        """A LongRoPE model's original context, past which its long factors apply (`models.rotary.rope_tables`)."""
        rs = self.rope_scaling
        return rs.original_max_position_embeddings if rs.rope_type == "longrope" else None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UnsupportedModelError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rotary = self.rotary_dims
        if rotary % 2 or not 0 < rotary <= self.head_dim:
            raise UnsupportedModelError(f"the rotary dims must be even and 1 to head_dim ({self.head_dim}), got {rotary}")
        for name in ("short_factor", "long_factor", "freq_factors"):  # one per rotary pair
            factors = getattr(self.rope_scaling, name)
            if factors is not None and len(factors) != rotary // 2:
                raise UnsupportedModelError(f"rope scaling {name} has {len(factors)} values; the {rotary} rotary dims "
                                            f"of head_dim {self.head_dim} make {rotary // 2} pairs")
        acts = ("silu", "gelu_pytorch_tanh") if self.gated_mlp else ("relu2", "xielu", "gelu_pytorch_tanh", "gelu")
        if self.hidden_act not in acts:
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r} is not supported for {self.family} "
                                        f"({', '.join(acts)})")
        if self.layer_types is not None and (len(self.layer_types) != self.num_layers
                                             or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise UnsupportedModelError(f"layer_types must give one of {LAYER_TYPES} for each of the "
                                        f"{self.num_layers} layers, got {self.layer_types}")
        if self.no_rope_layers is not None and (len(self.no_rope_layers) != self.num_layers
                                                or not set(self.no_rope_layers) <= {0, 1}):
            raise UnsupportedModelError(f"no_rope_layers must give 0 or 1 for each of the {self.num_layers} layers, "
                                        f"got {self.no_rope_layers}")
        if self.sliding_window is not None and self.sliding_window <= 0 or (self.attention_chunk or 1) <= 0:
            raise UnsupportedModelError(f"sliding_window ({self.sliding_window}) and attention_chunk "
                                        f"({self.attention_chunk}) must be positive")
        if self.query_scale_beta and self.query_scale_length <= 0:
            raise UnsupportedModelError(f"query_scale_beta ({self.query_scale_beta}) needs a positive "
                                        f"query_scale_length ({self.query_scale_length})")
        fields.check_moe(self)
        check_mla(self)
        if self.mamba is not None:
            self.mamba.check(self.num_layers)
        if self.weight_quant:
            check_method(self.weight_quant, self.num_experts)
        if self.gemma4 is not None:
            check_gemma4(self)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_pool_heads(self) -> int:
        """The page pool's heads of `head_dim` a token's entries fill: `num_kv_heads`, or as many as Gemma 4's wider
        kind of keys fill (`config_gemma4`)."""
        g = self.gemma4
        return self.num_kv_heads if g is None else max(self.num_kv_heads * self.head_dim,
                                                       g.num_kv_heads * g.head_dim) // self.head_dim

    @property
    def kv_cache_dims(self) -> tuple[int, int]:
        """The dims of a key's and of a value's page entries: an MLA model's pages hold its latent and rotary key
        (and its indexer's key) as keys, and no values (the latent serves as both)."""
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.rotary_dims + self.index_head_dim, 0
        return self.head_dim, self.head_dim

    @property
    def sm_scale(self) -> float:
        if self.kv_lora_rank:
            return mla_softmax_scale(self.head_dim, self.rope_scaling)
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer attends alike (else the window and rotary tables differ by layer: `layer_kind`)."""
        return self.layer_period == 1

    def dense_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is dense in a MoE model (its weights in `Params.dense_layers`): the first
        `first_dense_layers`, or all but every `moe_layer_step`-th; of Gemma 4 (its MLPs all alike), whether `layer`
        is a full-attention layer, whose wider heads are stacked apart."""
        if self.gemma4 is not None:
            return self.layer_types is not None and self.layer_types[layer] == "full_attention"
        return layer < self.first_dense_layers or (self.moe_layer_step > 1 and (layer + 1) % self.moe_layer_step != 0)

    @property
    def num_dense_layers(self) -> int:
        """How many layers `Params.dense_layers` stacks."""
        return sum(self.dense_layer(i) for i in range(self.num_layers)) if self.num_experts or self.gemma4 else 0

    def stack_index(self, layer, dense: bool):
        """`layer`'s row in its stack (`Params.dense_layers` when `dense`, else `Params.layers`); `layer` an int or
        traced, `dense` what `dense_layer` says of it."""
        if self.gemma4 is not None:  # (its layers of `layer`'s kind before it: a table lookup, `layer` maybe traced)
            import jax.numpy as jnp

            full = [self.dense_layer(i) for i in range(self.num_layers)]
            rows = [sum(full[:i]) if full[i] else i - sum(full[:i]) for i in range(self.num_layers)]
            return rows[layer] if isinstance(layer, int) else jnp.asarray(rows, jnp.int32)[layer]
        if self.moe_layer_step > 1:  # (experts at layers step - 1, 2 step - 1, ...: layer // step before `layer`)
            return layer - layer // self.moe_layer_step if dense else layer // self.moe_layer_step
        return layer if dense else layer - self.first_dense_layers

    @property
    def layer_period(self) -> int:
        """The shortest period of the layers' kinds (Gemma 2: 2, Gemma 3: 6, SmolLM3: 4; 1 when all are alike)."""
        return self.period_from(0)

    def period_from(self, start: int) -> int:
        """The shortest period of the kinds of layers `start` on (Command A MoE's past its dense first layer)."""
        kinds = [self.layer_kind(i) for i in range(start, self.num_layers)]
        return next((p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds))), 1)

    def is_local(self, layer: int) -> bool:
        """Whether `layer` is a sliding-window layer."""
        if self.layer_types is not None and self.layer_types[layer] == "chunked_attention":
            return self.attention_chunk is not None  # (a chunk's own keys, as a window's)
        windowed = self.layer_types is None or self.layer_types[layer] == "sliding_attention"
        return self.sliding_window is not None and windowed

    @property
    def output_norms(self) -> bool:
        """Whether the layers also norm the attention's and the MLP's outputs (Gemma 2 on, GLM-4, OLMo 2, AFMoE)."""
        return self.family in ("gemma2", "gemma3", "gemma4", "glm4", "afmoe", "olmo_hybrid", "lfm3",
                               *POST_NORM_FAMILIES)

    @property
    def input_norms(self) -> bool:
        """Whether the layers norm the attention's and the MLP's inputs (all but OLMo 2, which norms outputs only)."""
        return self.family not in POST_NORM_FAMILIES

    @property
    def qk_norm_heads(self) -> bool:
        """Whether q and k are normed over all their heads at once (OLMo 2: a weight per head and dim), not apart."""
        return self.family in (*OLMO_FAMILIES, "olmoe", "minimax_m2")

    @property
    def qk_norm_weights_per_head(self) -> bool:
        """Whether the q and k norms have a weight per head and dim (OLMo 2; Command R+, StableLM 2 12B: apart)."""
        return self.family in (*OLMO_FAMILIES, *COHERE_FAMILIES, "olmoe", "minimax_m2", "stablelm")

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP is gated, act(gate) * up (else act(up): `config_families.UNGATED_MLP_FAMILIES`)."""
        return self.family not in UNGATED_MLP_FAMILIES

    @property
    def attn_gate_width(self) -> int:
        """Each head's output gated by the sigmoid of this many more query outputs (after its query in `wq`'s last
        axis): one a channel (Qwen3-Next's; AFMoE's `gate_proj`), one for all (LFM3's `g_proj`); 0: no gate."""
        return 1 if self.family == "lfm3" else self.head_dim if self.family in (*GATED_DELTA_FAMILIES, "afmoe") else 0

    @property
    def q_head_dim(self) -> int:
        """A head's outputs of the query projection: its query, then its gate where attention's output is gated."""
        return self.head_dim + self.attn_gate_width

    @property
    def expert_width(self) -> int:
        """The experts' input and output width: a latent MoE's (`moe_latent_size`), else the model's."""
        return self.moe_latent_size or self.hidden_size

    @property
    def shared_expert_gated(self) -> bool:
        """Whether the shared expert's output is scaled by a sigmoid of the input (`LayerParams.ws_mix`: Qwen's)."""
        return self.family in ("qwen2_moe", *GATED_DELTA_FAMILIES)

    @property
    def parallel_block(self) -> bool:
        """Whether attention and the MLP read the layer's input, their outputs added to it (Cohere, Phi, GPT-NeoX)."""
        return self.family in (*COHERE_FAMILIES, "phi", "gptj", "gpt_neox") if self.parallel_residual is None \
            else self.parallel_residual

    @property
    def mlp_own_norm(self) -> bool:
        """Whether the MLP reads a norm of its own, not attention's normed input (parallel blocks' one: Phi's)."""
        return not self.parallel_block or self.parallel_norms == 2

    @property
    def attention_sinks(self) -> bool:
        """Whether each head's softmax has a learned sink logit (`LayerParams.sinks`; gpt-oss, Granite SWA,
        MiMo-V2-Flash's windowed layers: `sinks_in`)."""
        return self.family in ("gpt_oss", "mimo_v2_flash", *GRANITE_SWA_FAMILIES)

    def sinks_in(self, layer: int) -> bool:
        """Whether `layer`'s checkpoint holds sinks (elsewhere its `LayerParams.sinks` row is -inf: none)."""
        every = self.family in ("gpt_oss", *GRANITE_SWA_FAMILIES)
        return self.attention_sinks and (every or self.layer_types is not None
                                         and self.layer_types[layer] == "sliding_attention")

    @property
    def norm_bias(self) -> bool:
        """Whether the norms are LayerNorms with a bias (Jais 2, StarCoder2, Phi)."""
        return self.family in BIASED_NORM_FAMILIES

    @property
    def output_bias(self) -> bool:
        """Whether the attention's output projection has a bias (not where q, k and v's are its only ones)."""
        return self.attention_bias and self.family not in (*QKV_BIAS_FAMILIES, *GLM_FAMILIES)

    def kind_config(self, local: bool) -> ModelConfig:
        """The config a layer of this kind attends by: Gemma 4's full-attention layers' own head width, KV heads and
        rotary embedding (`config_gemma4.full_attention_config`); else this one."""
        return self if self.gemma4 is None or local or self.gemma4.full_layers else full_attention_config(self)

    def layer_kind(self, layer: int) -> tuple[bool, bool]:
        """How `layer` attends: (a sliding-window layer, its queries and keys rotated by position)."""
        return self.is_local(layer), self.no_rope_layers is None or bool(self.no_rope_layers[layer])

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse an HF `config.json` dict; refuses architectures and options jaxserve does not implement. Of an
        image-text model (LLaVA's, Gemma 3's), the language model (the vision side is
        `models.vision.VisionConfig`'s)."""
        from jaxserve.config_parse import config_from_hf

        return config_from_hf(cls, d)

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict describing this model (for `jaxserve convert`)."""
        from jaxserve.config_hf import config_to_hf

        return config_to_hf(self)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], vocab_size: int, has_output_weight: bool,
                           rope_tensors: Mapping[str, Sequence[float]] | None = None,
                           tensor_names: Mapping[str, Any] | frozenset[str] = frozenset()) -> ModelConfig:
        """Parse llama.cpp GGUF metadata (jaxserve/loader/gguf_config.py)."""
        from jaxserve.loader.gguf_config import config_from_gguf

        return config_from_gguf(meta, vocab_size, has_output_weight, rope_tensors, tensor_names)
