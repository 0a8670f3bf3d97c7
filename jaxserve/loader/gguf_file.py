"""Reading llama.cpp GGUF files: metadata, config, and dequantized tensors under HF names."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from jaxserve.config import GEMMA_FAMILIES, GRANITE_MOE_FAMILIES, UNIT_NORM_FAMILIES, ModelConfig
from jaxserve.config_mla import MLA_FAMILIES
from jaxserve.config_qwen3_next import GATED_DELTA_FAMILIES
from jaxserve.loader.family_names import router_bias_name
from jaxserve.loader.gguf_afmoe import NAMES as AFMOE_NAMES
from jaxserve.loader.gguf_deepseek import mla_tensors
from jaxserve.loader.gguf_gemma4 import gemma4_tensor
from jaxserve.loader.gguf_header import GGUFHeader
from jaxserve.loader.gguf_hybrid import jamba_ssm_tensor, nemotron_h_tensors, shortconv_tensor, ssm_tensor
from jaxserve.loader.gguf_mimo2 import NAMES as MIMO2_NAMES
from jaxserve.loader.gguf_qwen3_next import NAMES as QWEN3_NEXT_NAMES
from jaxserve.loader.gguf_qwen3_next import gated_delta_tensor
from jaxserve.loader.keymap import CheckpointError

# Every tensor type the gguf package dequantizes (llama.cpp's legacy, K- and I-quants, ternary and MXFP4),
# each checked against transformers' reading of the same file (tests/test_gguf_models.py).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
                   "TQ1_0", "TQ2_0", "MXFP4")

_GGUF_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3's fused projections, split by the key map
    "attn_qkv.bias": "self_attn.qkv_proj.bias",  # (Phi-2's, in files from its first checkpoints)
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # (LayerNorms' and the MLP's biases: Jais 2's)
    "attn_norm.bias": "input_layernorm.bias",
    "ffn_norm.bias": "post_attention_layernorm.bias",
    "attn_norm_2.weight": "post_attention_layernorm.weight",  # (Falcon-40B's: the MLP's own norm beside attention)
    "attn_norm_2.bias": "post_attention_layernorm.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
# Gemma's norms: after attention and around the MLP (llama's `ffn_norm` is its pre-MLP norm, named
# `post_attention_layernorm` in HF Llama; in HF Gemma that name is the norm after attention).
_GEMMA_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Mixture-of-experts layers: the router, the experts stacked in one tensor per projection (older Mixtral
# files: one tensor per expert), and Qwen2-MoE's shared expert with its gate.
_EXPERT_KINDS = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}  # (Qwen, Mixtral)
_EXPERTS_RE = re.compile(r"^ffn_(gate|up|down)_exps\.(weight|bias)$")  # (biases: gpt-oss's)
_ONE_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")
_SHARED_EXPERT = {"ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                  "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                  "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
                  "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
# Rope scaling as per-pair frequency divisors: Llama 3.1's; LongRoPE's short and long (Phi-3's long-context
# models). Part of the config, not parameters.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# The norm before the MLP under llama.cpp's post-attention name (gpt-oss's, GLM-4.5's), gpt-oss's sinks.
_POST_ATTENTION_NORM = {"post_attention_norm.weight": "post_attention_layernorm.weight"}
_GPT_OSS_NAMES = {**_POST_ATTENTION_NORM, "attn_sinks.weight": "self_attn.sinks"}
# GLM-4.5's multi-token prediction layers: blocks after the model's, each with `nextn.*` tensors (read for
# speculative decoding alone, `engine.mtp`), named here as the HF checkpoints name them.
NEXTN_RE = re.compile(r"^blk\.(\d+)\.nextn\.")
_NEXTN_NAMES = {"shared_head_head.weight": "shared_head.head.weight", "shared_head_norm.weight": "shared_head.norm.weight"}


def gguf_to_hf_name(name: str, gemma: bool = False, phi3: bool = False, extra: dict[str, str] | None = None) -> str:
    """Translate a llama.cpp tensor name to the HF name (of a Gemma model with `gemma`, of Phi-3, whose
    `ffn_up` holds the gate and up projections, with `phi3`; `extra`: an architecture's own block tensor names);
    refuses names it does not know."""
    if name in ("token_embd.weight", "position_embd.weight"):  # (GPT-2's learned positions)
        return "model.embed_" + ("tokens" if name.startswith("token") else "positions") + ".weight"
    if name in ("output_norm.weight", "output_norm.bias", "token_embd_norm.weight", "token_embd_norm.bias"):
        return ("model.norm." if name.startswith("output") else "model.embed_norm.") + name.rsplit(".", 1)[1]
    if name in ("output.weight", "output.bias"):  # (Phi-2's head has a bias)
        return "lm_head." + name.rsplit(".", 1)[1]
    m = _BLK_RE.match(name)
    names = {**_GGUF_TO_HF, **_GEMMA_NAMES} if gemma else _GGUF_TO_HF
    if phi3:
        names = {**names, "ffn_up.weight": "mlp.gate_up_proj.weight"}
    if extra:
        names = {**names, **extra}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    raise CheckpointError(f"unknown GGUF tensor {name!r}")


def hf_tensors(name: str, arr: np.ndarray, cfg: ModelConfig, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """The HF tensors (names and arrays in HF layout) of llama.cpp tensor `name` holding `arr` (GGUF shape
    reversed) in a file of architecture `arch`: one, or one per expert of a stacked expert tensor."""
    m = _BLK_RE.match(name)
    if cfg.family == "gemma4" and (found := gemma4_tensor(name, *(m.groups() if m else (None, None)), arr)):
        yield found
        return
    if cfg.family == "lfm2":  # (its final norm under the embeddings' name)
        lfm2 = ("model.norm.weight", arr) if name == "token_embd_norm.weight" else m and shortconv_tensor(*m.groups(), arr)
        if lfm2:
            yield lfm2
            return
    if cfg.family == "nemotron_h" and m and (blocks := nemotron_h_tensors(*m.groups(), arr)) is not None:
        yield from blocks
        return
    if cfg.family in GATED_DELTA_FAMILIES and m and (found := gated_delta_tensor(*m.groups(), arr, cfg, arch)):
        yield found
        return
    read_ssm = jamba_ssm_tensor if cfg.mamba is not None and cfg.mamba.kind == "mamba1" else ssm_tensor
    if cfg.mamba is not None and m and (found := read_ssm(f"model.layers.{m.group(1)}.mamba.", m.group(2), arr)):
        yield found
        return
    if cfg.kv_lora_rank and m:
        found = mla_tensors(f"model.layers.{m.group(1)}.", m.group(2), arr)
        if found is not None:
            yield from found
            return
    if cfg.num_experts and m:
        layer, rest = m.groups()
        fused = cfg.family in ("mixtral", "minimax_m2", *GRANITE_MOE_FAMILIES)  # (Mixtral's names: Granite's experts
        # split so)
        prefix = f"model.layers.{layer}.{'block_sparse_moe' if fused else 'mlp'}"
        stacked, single = _EXPERTS_RE.match(rest), _ONE_EXPERT_RE.match(rest)
        if rest in ("ffn_gate_inp.weight", "ffn_gate_inp.bias"):
            yield f"{prefix}.{'router' if cfg.family in ('gpt_oss', 'jamba') else 'gate'}.{rest.rsplit('.', 1)[1]}", arr
            return
        if rest == "exp_probs_b.bias":  # the bias choosing experts (ERNIE's [1, X])
            yield f"{prefix}.{router_bias_name(cfg.family)}", arr
            return
        if stacked or single:
            kind = _EXPERT_KINDS[(stacked or single).group(1)][fused]
            if single:
                yield f"{prefix}.experts.{single.group(2)}.{kind}.weight", arr
            else:
                part = stacked.group(2)
                yield from ((f"{prefix}.experts.{j}.{kind}.{part}", arr[j]) for j in range(arr.shape[0]))
            return
        if rest in _SHARED_EXPERT:
            hf = _SHARED_EXPERT[rest]
            if cfg.family in ("glm4_moe", "ernie4_5_moe", "afmoe", *MLA_FAMILIES):  # (shared experts: one module)
                hf = hf.replace("shared_expert.", "shared_experts.")
            yield f"model.layers.{layer}.{hf}", arr.reshape(1, -1) if arr.ndim == 1 else arr
            return
    # (OLMo 2's and EXAONE 4's norms after attention and after the MLP are named as Gemma's)
    extra = _GPT_OSS_NAMES if cfg.family == "gpt_oss" else _POST_ATTENTION_NORM if cfg.family == "glm4_moe" else \
        QWEN3_NEXT_NAMES if cfg.family in GATED_DELTA_FAMILIES else \
        MIMO2_NAMES if cfg.family == "mimo_v2_flash" else AFMOE_NAMES if cfg.family == "afmoe" else None
    gemma = cfg.family in GEMMA_FAMILIES and cfg.output_norms or arch in ("olmo2", "exaone4", "afmoe")
    yield gguf_to_hf_name(name, gemma, arch == "phi3", extra), arr


def prediction_blocks(names: Iterable[str]) -> set[int]:
    """The blocks holding multi-token prediction layers (`nextn.*` tensors: GLM-4.5's), read for drafting alone."""
    return {int(m.group(1)) for name in names if (m := NEXTN_RE.match(name))}


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs) to HF's half-split layout."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_reader(path: str | os.PathLike) -> GGUFHeader:
    """The parsed header (`GGUFHeader`) of the file at `path`, parsed once per process while the file is
    unchanged (same size and modification time): the config, the tokenizer, the sampling defaults and every
    engine on the same file read it."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return _parsed_reader(real, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parsed_reader(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    return GGUFHeader(path)  # a read-only memory map


class GGUFFile:
    """A GGUF file opened for reading (memory-mapped; nothing is dequantized until asked)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            self.reader = gguf_reader(self.path)
        except Exception as e:  # the gguf package raises assorted errors on damaged files
            raise CheckpointError(f"{self.path} is not a readable GGUF file (truncated or damaged?): {e}") from e
        size = os.path.getsize(self.path)
        end = self.reader.data_end
        if end > size:
            raise CheckpointError(
                f"{self.path} is truncated: its tensors need {end} bytes, the file has {size}"
            )
        # The large arrays are the tokenizer's, which reads them from the header.
        self.metadata: dict[str, Any] = {k: v for k, v in self.reader.values.items()
                                         if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                                      "tokenizer.ggml.token_type")}

    def config(self) -> ModelConfig:
        tensors = {t.name: t for t in self.reader.tensors}
        vocab = self.metadata.get(f"{self.metadata.get('general.architecture')}.vocab_size")
        if vocab is None:
            vocab = len(self.reader.values.get("tokenizer.ggml.tokens", ()))
        rope = {}
        for name in _ROPE_TENSORS:
            t = tensors.get(name)
            if t is not None and t.tensor_type.name != "F32":
                raise CheckpointError(f"GGUF tensor {name!r} has type {t.tensor_type.name}; it must be F32")
            if t is not None:
                rope[name.removesuffix(".weight")] = np.asarray(t.data, np.float32).ravel().tolist()
        return ModelConfig.from_gguf_metadata(self.metadata, int(vocab), "output.weight" in tensors, rope,
                                              {name: tuple(reversed(t.shape)) for name, t in tensors.items()})

    def tensors(self, cfg: ModelConfig, prediction: bool = False) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (HF name, float32 array in HF layout) for every tensor, dequantizing one at a time; the multi-token
        prediction blocks' alone with `prediction` (as `model.layers.N.`: the block's decoder layer, and its `nextn`
        tensors under DeepSeek's names, `eh_proj`, `shared_head.head` ...)."""
        import gguf

        arch = self.metadata.get("general.architecture")
        # llama.cpp writes their Q/K rows in its rotary order
        permuted = arch in ("llama", "mistral", "granite", "granitemoe", "smollm3", "granitehybrid", "nemotron_h",
                            "nemotron_h_moe", "falcon-h1", "olmo")
        unit = cfg.family in UNIT_NORM_FAMILIES  # (RMSNorms scaled by 1 + w, stored as 1 + w)
        predicting = prediction_blocks(t.name for t in self.reader.tensors)
        for t in self.reader.tensors:
            block = _BLK_RE.match(t.name)
            if t.name in _ROPE_TENSORS or (block is not None and int(block.group(1)) in predicting) != prediction:
                continue
            kind = t.tensor_type.name
            if kind not in SUPPORTED_TYPES:
                raise CheckpointError(
                    f"GGUF tensor {t.name!r} has type {kind}, not supported (supported: {', '.join(SUPPORTED_TYPES)})"
                )
            if kind == "F32":
                arr = np.asarray(t.data, np.float32)
            elif kind == "F16":
                arr = np.asarray(t.data).astype(np.float32)
            else:
                arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            arr = arr.reshape(tuple(reversed(t.shape)))
            if (nextn := NEXTN_RE.match(t.name)) is not None:
                rest = t.name[nextn.end():]
                yield f"model.layers.{nextn.group(1)}.{_NEXTN_NAMES.get(rest, rest)}", arr
                continue
            for name, a in hf_tensors(t.name, arr, cfg, arch):
                if permuted and name.endswith(("self_attn.q_proj.weight", "mixer.q_proj.weight")):
                    a = unpermute_rotary(a, cfg.num_heads)
                elif permuted and name.endswith(("self_attn.k_proj.weight", "mixer.k_proj.weight")):
                    a = unpermute_rotary(a, cfg.num_kv_heads)
                elif unit and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                    a = a - 1.0  # llama.cpp stores Gemma's and Qwen3-Next's (1 + w) norms as 1 + w
                yield name, a

    @property
    def quantized(self) -> bool:
        """Whether a tensor is stored in one of llama.cpp's quantized types (not F32, F16 or BF16)."""
        return any(t.tensor_type.name not in ("F32", "F16", "BF16") for t in self.reader.tensors)

    def __len__(self) -> int:
        return len(self.reader.tensors)
