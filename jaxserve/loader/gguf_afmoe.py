"""llama.cpp's AFMoE files (Arcee's Trinity, architecture "afmoe") as the HF config `config_afmoe` reads, and their
tensors' own names.

llama.cpp's converter writes Llama's keys and the experts' (`expert_count`, `expert_used_count`,
`expert_feed_forward_length`, `expert_shared_count`, `leading_dense_block_count`, `expert_weights_norm`,
`expert_weights_scale`) and the window; its runtime takes the rest as the released models have them: every 4th layer
global and unrotated, the others windowed, experts chosen by sigmoid score plus the bias (`exp_probs_b`), the
embeddings scaled by sqrt(hidden_size) (muP). q and k are not permuted (NeoX rotation); the gate's projection is
`attn_gate`; the four norms are Gemma's (`ffn_norm` the MLP's pre-norm)."""

from __future__ import annotations

from typing import Any

from jaxserve.errors import UnsupportedModelError

# llama.cpp's pattern for the architecture: 3 windowed layers, then a global one (`global_attn_every_n_layers`)
GLOBAL_EVERY = 4
NAMES = {"attn_gate.weight": "self_attn.gate_proj.weight"}
_SIGMOID = 2  # (llama.cpp's `expert_gating_func`: 1 softmax, 2 sigmoid; absent: sigmoid)


def afmoe_gguf_hf(meta: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    """The HF config of an AFMoE file's metadata `meta` (`d`: the keys every architecture's file gives)."""
    get = lambda key, default=None: meta.get(f"afmoe.{key}", default)  # noqa: E731
    if not d.get("sliding_window"):
        raise UnsupportedModelError("AFMoE GGUF files without afmoe.attention.sliding_window are not supported "
                                    "(its global layers are known by the window's pattern)")
    if int(get("expert_gating_func") or _SIGMOID) != _SIGMOID:
        raise UnsupportedModelError(f"AFMoE GGUF expert_gating_func {get('expert_gating_func')} is not supported "
                                    "(sigmoid, 2)")
    if not get("expert_weights_norm", True):  # (transformers renormalizes the chosen experts' weights always)
        raise UnsupportedModelError("AFMoE GGUF files with expert_weights_norm false are not supported")
    return {**d, "model_type": "afmoe", "num_experts": d["num_experts"],
            "num_shared_experts": int(get("expert_shared_count") or 0),
            "num_dense_layers": int(get("leading_dense_block_count") or 0),
            "route_scale": float(get("expert_weights_scale") or 1.0), "global_attn_every_n_layers": GLOBAL_EVERY,
            "mup_enabled": True}
