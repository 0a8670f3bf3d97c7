"""EXAONE 3.0 / 3.5 checkpoints (`ExaoneForCausalLM`): Llama's modules under LG's names, read as Llama's."""

from __future__ import annotations

import re

_EXAONE_RE = re.compile(r"^transformer\.h\.(\d+)\.(ln_1|ln_2|attn\.attention\.(?:[qkv]_proj|out_proj)|mlp\.c_fc_[01]|"
                        r"mlp\.c_proj)\.weight$")
_EXAONE_MODULES = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.attention.q_proj":
                   "self_attn.q_proj", "attn.attention.k_proj": "self_attn.k_proj", "attn.attention.v_proj":
                   "self_attn.v_proj", "attn.attention.out_proj": "self_attn.o_proj", "mlp.c_fc_0": "mlp.gate_proj",
                   "mlp.c_fc_1": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}


def exaone_name(name: str) -> str:
    """An EXAONE 3 tensor's Llama name (`transformer.wte`, `transformer.h.N.attn.attention.q_proj`, ...); any other
    name under `transformer.` as it is."""
    if name in ("transformer.wte.weight", "transformer.ln_f.weight"):
        return "model.embed_tokens.weight" if "wte" in name else "model.norm.weight"
    m = _EXAONE_RE.match(name)
    return f"model.layers.{m.group(1)}.{_EXAONE_MODULES[m.group(2)]}.weight" if m else name
