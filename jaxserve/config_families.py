"""The model families jaxserve serves and the HF architectures read as each (`ModelConfig.from_hf`)."""

from __future__ import annotations

from typing import Literal

Family = Literal["llama", "gemma", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3",
                 "granite",
                 "granitemoe", "granitemoeshared", "granitemoehybrid", "smollm3", "glm", "glm4", "glm4_moe", "ernie4_5",
                 "ernie4_5_moe", "dots1", "olmo2", "olmo3", "gpt_oss", "exaone4", "cohere", "cohere2", "olmoe", "arcee",
                 "apertus", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "bamba", "nemotron_h", "lfm2",
                 "qwen3_next", "qwen3_5", "minimax_m2", "llama4", "mistral4", "glm4_moe_lite",
                 "hunyuan_v1_dense", "hunyuan_v1_moe", "exaone_moe", "afmoe", "flex_olmo", "mimo_v2_flash",
                 "cohere2_moe", "jais2", "olmo_hybrid", "falcon_h1", "jamba", "granite_swa", "granitemoe_swa", "gemma4",
                 "lfm3", "mamba", "falcon_mamba", "mamba2", "starcoder2", "phi", "stablelm",
                 "nemotron", "gpt2", "gpt_bigcode", "olmo", "ministral", "helium", "gpt_neox",
                 "gptj", "falcon", "mpt", "bloom"]
BIASED_NORM_FAMILIES: tuple[str, ...] = ("jais2", "starcoder2", "phi", "stablelm", "nemotron", "gpt2", "gpt_bigcode",
                                         "gpt_neox", "gptj", "falcon", "bloom")
"""LayerNorms with biases; attention's and the MLP's biases where the config says."""
# The MLP ungated, act(up): Arcee's, Apertus', Nemotron-H's, and all but StableLM's of the LayerNorm families above
UNGATED_MLP_FAMILIES: tuple[str, ...] = ("arcee", "apertus", "nemotron_h", "mpt", *(f for f in BIASED_NORM_FAMILIES
                                                                                    if f != "stablelm"))
UNBIASED_LAYER_NORM_FAMILIES: tuple[str, ...] = ("mpt",)  # LayerNorms with weights, without biases (Cohere's too)
HEAD_BIAS_FAMILIES: tuple[str, ...] = ("phi", "gptj")  # the LM head has a bias (`Params.lm_head_b`)
# Learned absolute positions, no rotary embedding (`Params.pos_embed`): GPT-2's, GPTBigCode's (`config_gpt2`)
LEARNED_POSITION_FAMILIES: tuple[str, ...] = ("gpt2", "gpt_bigcode")
EMBED_NORM_FAMILIES: tuple[str, ...] = ("bloom",)  # a LayerNorm of the embeddings (`Params.embed_norm`)
# Attention biases on q, k and v only, none on the output projection (GLM's too: `config.GLM_FAMILIES`)
QKV_BIAS_FAMILIES: tuple[str, ...] = ("qwen2", "qwen2_moe", "glm4_moe", "stablelm", "helium")
WEIGHTLESS_NORM_FAMILIES: tuple[str, ...] = ("olmo",)  # LayerNorms without weights or biases (held as ones)

HF_ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "HeliumForCausalLM": "helium",  # Helium (Kyutai): Llama's layers, rotary pairs interleaved, float32 norm weights
    "MinistralForCausalLM": "ministral",  # Ministral 8B: Mistral's layers, each windowed or global by `layer_types`
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GemmaForCausalLM": "gemma",  # Gemma (1), CodeGemma: Llama's layers, Gemma's norms, scaled embeddings, GELU
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",  # full-attention layers with wider heads, k = v; experts beside the MLP
    "GraniteForCausalLM": "granite",
    "GraniteSWAForCausalLM": "granite_swa",  # Granite's layers, most windowed, sinks, a rotary base per layer kind
    "GraniteMoeSWAForCausalLM": "granitemoe_swa",  # ... with Granite MoE's experts and shared MLP
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeSharedForCausalLM": "granitemoeshared",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",  # Granite 4.0: attention only, or Mamba-2 layers beside it
    "BambaForCausalLM": "bamba",  # Mamba-2 layers beside Llama's attention
    "NemotronHForCausalLM": "nemotron_h",  # Mamba-2, attention (no rotary embedding) and MLP blocks (`config_nemotron`)
    "Lfm2ForCausalLM": "lfm2", "Lfm2MoeForCausalLM": "lfm2",  # short gated convolutions beside attention (`config_lfm2`)
    "Lfm3ForCausalLM": "lfm3",  # ... beside windowed and full attention, its heads gated, Gemma's four norms
    "SmolLM3ForCausalLM": "smollm3",
    "GlmForCausalLM": "glm",
    "Glm4ForCausalLM": "glm4",
    "Glm4MoeForCausalLM": "glm4_moe",  # GLM-4.5, GLM-4.6 (their multi-token prediction layers are not read)
    "Ernie4_5ForCausalLM": "ernie4_5",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",  # ERNIE 4.5 MoE (its multi-token prediction tensors are not read)
    "Dots1ForCausalLM": "dots1",  # dots.llm1: Qwen3's attention, DeepSeek-V3's experts
    "OlmoForCausalLM": "olmo",  # OLMo (1): Llama's layers under LayerNorms without weights, q/k/v clamped
    "Olmo2ForCausalLM": "olmo2",  # norms after attention and the MLP only; q and k normed over all their heads
    "Olmo3ForCausalLM": "olmo3",  # OLMo 2's layers, three of four windowed
    "Exaone4ForCausalLM": "exaone4",  # OLMo 2's norms after attention and the MLP; three of four layers windowed
    "CohereForCausalLM": "cohere",  # Command R: LayerNorm, attention and MLP side by side, interleaved rotary pairs
    "Cohere2ForCausalLM": "cohere2",  # Command R7B, Command A: Cohere's layers, three of four windowed, the rest NoPE
    "Jais2ForCausalLM": "jais2",  # Jais 2: Llama's attention (biased), LayerNorms with biases, a squared-ReLU MLP
    "Starcoder2ForCausalLM": "starcoder2",  # StarCoder2: Jais 2's layers with a tanh-GELU MLP, Mistral's window
    "PhiForCausalLM": "phi",  # Phi-1, 1.5, 2: StarCoder2's layers, attention and the MLP on one norm; the head biased
    "StableLmForCausalLM": "stablelm",  # StableLM 2, 3B-4E1T: Llama's layers, LayerNorms with biases, q/k/v biased
    "GPT2LMHeadModel": "gpt2",  # GPT-2: learned positions, StarCoder2's layers otherwise (`config_gpt2`)
    "GPTNeoXForCausalLM": "gpt_neox",  # Pythia: attention and the MLP side by side, each on its own LayerNorm
    "FalconForCausalLM": "falcon",  # Falcon: GPT-NeoX's blocks (one norm or two, or sequential), q/k/v fused by KV head
    "BloomForCausalLM": "bloom",  # BLOOM: GPT-NeoX's q/k/v per head, sequential blocks, ALiBi, a norm of the embeddings
    "MptForCausalLM": "mpt",  # MPT: LayerNorms without biases, no biases, an exact-GELU MLP, ALiBi
    "GPTBigCodeForCausalLM": "gpt_bigcode",  # StarCoder, SantaCoder: GPT-2's layers, one KV head
    "GPTJForCausalLM": "gptj",  # GPT-J: Phi's block (one norm, the head biased), rotary pairs interleaved
    "NemotronForCausalLM": "nemotron",  # Nemotron-4, Minitron: LayerNorms scaled by (1 + w), a squared-ReLU MLP
    "Cohere2MoeForCausalLM": "cohere2_moe",  # Command A MoE: Command R7B's layers with experts (`config_cohere2_moe`)
    "ArceeForCausalLM": "arcee",  # AFM: Llama with an ungated MLP, squared ReLU
    "ApertusForCausalLM": "apertus",  # an ungated MLP with xIELU (learned per layer), q/k norms
    "OlmoeForCausalLM": "olmoe",  # OLMoE: OLMo's q/k norms over all heads, 64 experts
    "FlexOlmoForCausalLM": "flex_olmo",  # FlexOlmo: OLMo 2's layers (norms after attention and the MLP), OLMoE's experts
    "GptOssForCausalLM": "gpt_oss",  # attention sinks, every other layer windowed; biased experts (MXFP4 dequantized)
    "DeepseekV2ForCausalLM": "deepseek_v2",  # multi-head latent attention (`config_mla`), softmax-routed experts
    "DeepseekV3ForCausalLM": "deepseek_v3",  # ... sigmoid-routed (Kimi K2, Moonlight); MTP layers not read
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",  # GLM-4.7-Flash: DeepSeek-V3's attention and experts (GLM-4.5's)
    # ... DeepSeek Sparse Attention: an indexer picks the keys each token attends (`config_mla.DSA_FAMILIES`)
    "DeepseekV32ForCausalLM": "deepseek_v32", "GlmMoeDsaForCausalLM": "glm_moe_dsa",  # (GLM-5)
    "Phi3ForCausalLM": "mistral",  # q/k/v and gate/up fused (split at load); written back as Mistral
    # Gated DeltaNet layers beside gated attention (`config_qwen3_next`): Qwen3-Next, Qwen3.5 (dense and MoE)
    "Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5ForCausalLM": "qwen3_5", "Qwen3_5MoeForCausalLM": "qwen3_5",
    "OlmoHybridForCausalLM": "olmo_hybrid",  # ... beside OLMo 3's attention, norms by layer kind (`config_olmo_hybrid`)
    "FalconH1ForCausalLM": "falcon_h1",  # Mamba-2 and attention side by side in every layer (`config_falcon_h1`)
    "JambaForCausalLM": "jamba",  # Mamba (selective scan) beside NoPE attention, experts every other layer
    # Mamba layers alone, no attention or MLP (`config_mamba_lm`)
    "MambaForCausalLM": "mamba", "FalconMambaForCausalLM": "falcon_mamba", "Mamba2ForCausalLM": "mamba2",
    # q and k normed over all their heads (OLMo 2's), half of each head rotated; sigmoid-routed experts with a bias
    # for choosing, renormalized (Mixtral's tensor names)
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "Llama4ForCausalLM": "llama4",  # Llama 4's language model (`config_llama4`)
    "Mistral4ForCausalLM": "mistral4",  # Mistral Small 4's language model (`config_mla`)
    # Hunyuan (Tencent): q and k normed after the rotation, NTK-alpha rotary bases; A13B's softmax-routed experts beside
    # an ungated shared MLP (`config_hunyuan`)
    "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense", "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe",
    "ExaoneMoeForCausalLM": "exaone_moe",  # K-EXAONE: EXAONE 4's attention, DeepSeek-V3's experts (`config_exaone_moe`)
    "MiMoV2FlashForCausalLM": "mimo_v2_flash",  # windowed layers with sinks beside full ones, narrower values (`config_mimo`)
    "AfmoeForCausalLM": "afmoe",  # Arcee Trinity: gated attention, Gemma's four norms, sigmoid-routed experts (`config_afmoe`)
}
