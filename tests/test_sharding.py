"""Tensor parallelism: the rules object's refusals (in process) and, on 8 simulated CPU devices in a
child process, sharded logits against unsharded for TP 1, 2, 4, 8, greedy generation through the
engine at TP=2 with no compilation after warmup, and two TP=2 replicas behind the data-parallel facade."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from jaxserve.engine_args import EngineArgs
from sharding import MESH_AXES, ParallelConfig, ShardingError, ShardingRules, make_plan
from tests.test_sharding_worker import PROMPTS, dense_config, moe_config, run_cases

REL_TOL = 1e-5


def mesh(tp: int = 1, ep: int = 1) -> AbstractMesh:
    return AbstractMesh((1, ep, tp), MESH_AXES)


@pytest.fixture(scope="module")
def results() -> dict:
    return run_cases("dense", "engine", "dp", "checkpoint", "load", "sleep", "images", "quant", "draft", "mtp", "eagle",
                     "hybrid")


# -- rules, in process --------------------------------------------------------------------------------

def test_rules_map_logical_axes_to_mesh_axes():
    rules = ShardingRules()
    assert rules.spec(("layers", "embed", "q_heads", "head_dim")) == PartitionSpec(None, None, "model", None)
    assert rules.spec(("vocab", "embed")) == PartitionSpec("model", None)
    assert rules.spec(("layers", "experts", "embed", "expert_mlp")) == PartitionSpec(None, "expert", None, "model")


def test_rules_refuse_two_logical_axes_on_one_mesh_axis():
    rules = ShardingRules().replace(embed="model")
    with pytest.raises(ShardingError, match=r"'embed' and 'q_heads' of one array both map to mesh axis 'model'"):
        rules.spec(("layers", "embed", "q_heads", "head_dim"))
    with pytest.raises(ShardingError, match="both map to mesh axis 'model'"):
        make_plan(dense_config(), mesh(tp=2), rules)


def test_rules_refuse_unknown_mesh_axis_and_unknown_logical_axis():
    with pytest.raises(ShardingError, match="unknown mesh axes"):
        ShardingRules().replace(q_heads="tensor")
    with pytest.raises(ShardingError, match="no sharding rule for logical axis 'heads'"):
        ShardingRules().spec(("heads",))


def test_plan_refuses_heads_not_divisible():
    cfg = dataclasses.replace(dense_config(), num_heads=6, num_kv_heads=2)
    with pytest.raises(ShardingError, match=r"num_heads \(attention heads\) = 6 is not divisible by "
                                            r"tensor_parallel_size = 4"):
        make_plan(cfg, mesh(tp=4))


def test_plan_refuses_kv_heads_neither_dividing_nor_divided():
    cfg = dataclasses.replace(dense_config(), num_heads=12, num_kv_heads=3)
    with pytest.raises(ShardingError, match=r"num_kv_heads \(KV heads\) = 3 cannot be split over 2 devices"):
        make_plan(cfg, mesh(tp=2))


def test_plan_refuses_mlp_not_divisible_and_experts_not_divisible():
    with pytest.raises(ShardingError, match=r"intermediate_size \(MLP width\) = 100 is not divisible"):
        make_plan(dataclasses.replace(dense_config(), intermediate_size=100), mesh(tp=8))
    with pytest.raises(ShardingError, match=r"num_experts = 8 is not divisible by expert_parallel_size = 3"):
        make_plan(moe_config(), mesh(ep=3))
    with pytest.raises(ShardingError, match="expert_parallel_size 2 needs a mixture-of-experts model"):
        make_plan(dense_config(), mesh(ep=2))


def test_plan_replicates_kv_heads_below_tp_and_logs_it(caplog):
    with caplog.at_level(logging.INFO, logger="sharding.plan"):
        plan = make_plan(dense_config(), mesh(tp=8))
    assert plan.kv_repeat == 4
    assert plan.model_cfg.num_kv_heads == 8 and plan.source_cfg.num_kv_heads == 2
    assert any("replicating each KV head 4 times" in r.message for r in caplog.records)
    assert make_plan(dense_config(), mesh(tp=2)).kv_repeat == 1


def test_plan_replicates_an_indivisible_vocabulary(caplog):
    with caplog.at_level(logging.INFO, logger="sharding.plan"):
        plan = make_plan(dataclasses.replace(dense_config(), vocab_size=66), mesh(tp=4))
    assert plan.rules.spec(("vocab", "embed")) == PartitionSpec(None, None)
    assert any("vocab_size 66 is not divisible" in r.message for r in caplog.records)


def test_parallel_sizes_are_engine_args_and_validated():
    args = EngineArgs(tensor_parallel_size=2, expert_parallel_size=2, data_parallel_size=2)
    pc = ParallelConfig(args.tensor_parallel_size, args.expert_parallel_size, args.data_parallel_size)
    assert pc.world_size == 8 and pc.devices_per_replica == 4
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="needs coordinator_address"):
        EngineArgs(num_processes=2, process_id=1)


def test_cli_flags_reach_engine_args():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--tensor-parallel-size", "4", "-ep", "2", "--data-parallel-size", "2"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.tensor_parallel_size, args.expert_parallel_size, args.data_parallel_size) == (4, 2, 2)


# -- 8 simulated devices, in a child process --------------------------------------------------------------

@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_logits_equal_unsharded(results, tp):
    r = results["dense"][f"tp{tp}_ep1"]
    assert r["num_devices"] == tp
    assert r["rel_prefill"] < REL_TOL and r["rel_decode"] < REL_TOL
    assert r["argmax_equal"]
    # The layout really splits: query heads, the vocabulary and the KV pool per device.
    assert r["wq_shard_heads"] == 8 // tp
    assert r["embed_shard_vocab"] == 64 // tp
    assert r["kv_repeat"] == max(1, tp // 2)
    assert r["kv_shard_heads"] == max(1, 2 // tp)


@pytest.mark.parametrize("tp", [4])
def test_tp_olmo2_logits_equal_unsharded(results, tp):
    """OLMo 2's q and k normed over all their heads, which tensor parallelism splits over devices (at TP=4 the two
    KV heads repeated, their norm weights with them); its norms after attention and the MLP only."""
    r = results["dense"][f"olmo2_tp{tp}_ep1"]
    assert r["num_devices"] == tp and r["wq_shard_heads"] == 8 // tp and r["kv_repeat"] == max(1, tp // 2)
    assert r["rel_prefill"] < REL_TOL and r["rel_decode"] < REL_TOL and r["argmax_equal"]


@pytest.mark.parametrize("tp", [2])
def test_tp_gemma_logits_equal_unsharded(results, tp):
    """Gemma 2's alternating windows, soft-caps and extra norms under tensor parallelism."""
    r = results["dense"][f"gemma2_tp{tp}_ep1"]
    assert r["num_devices"] == tp and r["wq_shard_heads"] == 8 // tp
    assert r["rel_prefill"] < REL_TOL and r["rel_decode"] < REL_TOL and r["argmax_equal"]


@pytest.mark.parametrize("name,tp", [("pallas_gemma2", 2), ("pallas", 4), ("falcon_rw", 2), ("pallas_falcon_rw", 2)])
def test_tp_kernels_on_each_devices_heads_equal_unsharded(results, name, tp):
    """The Pallas kernels (interpreted) under tensor parallelism, each device on its own query and KV heads
    (`jaxserve.models.head_shards`): Gemma 2's windows and soft-caps at TP=2, KV heads repeated at TP=4, Falcon-RW's
    ALiBi slopes (each device its heads'; on the XLA path too); the logits of the unsharded XLA path."""
    r = results["dense"][f"{name}_tp{tp}_ep1"]
    assert r["num_devices"] == tp and r["wq_shard_heads"] == 8 // tp
    assert r["rel_prefill"] < REL_TOL and r["rel_decode"] < REL_TOL and r["argmax_equal"]


def test_tp2_engine_greedy_is_token_identical_and_never_recompiles(results):
    r = results["engine"]
    assert r["tp2_devices"] == 2
    assert len(r["ref"]) == len(PROMPTS) and all(len(t) == 12 for t in r["ref"])
    assert r["tp2"] == r["ref"]
    assert r["compiles_after_warmup"] == 0
    assert r["single_compiles_after_warmup"] == 0
    # --kv-cache-dtype fp8 --calculate-kv-scales: TP=2 measures the scales one device does and equals it on
    # the same float8 cache (its own outputs, not float32's).
    assert r["fp8_pool"] == ["uint8", "float8_e4m3fn", 2]
    assert r["fp8_tp2"] == r["fp8_ref"] and all(len(t) == 12 for t in r["fp8_ref"])
    single, tp2 = r["fp8_scales"][:2], r["fp8_scales"][2:]
    np.testing.assert_allclose(tp2, single, rtol=1e-6)
    assert all(s != 1.0 for pair in single for s in pair)
    assert r["fp8_compiles_after_warmup"] == 0
    # An embedding model's pooling step, sharded: the same vectors, nothing compiled after warmup.
    pooled = r["pooled"]
    assert len(pooled["single"]) == len(PROMPTS) and all(len(v) == 64 for v in pooled["single"])
    np.testing.assert_allclose(pooled["tp2"], pooled["single"], atol=1e-5)
    assert pooled["tp2_compiles_after_warmup"] == 0 and pooled["single_compiles_after_warmup"] == 0


def test_a_hybrid_model_at_tp2_gives_one_devices_tokens(results):
    """Granite 4.0-H's (and Nemotron 3's, LFM3's (LFM2's layers with more), Qwen3-Next's, OLMo Hybrid's, Falcon-H1's,
    Jamba's) layers at TP=2: the attention layer's pages split by KV head, the Mamba layers' states whole on each
    device; one device's greedy tokens, nothing compiled after warmup, and again from the prefix cache's kept states;
    the same over two data-parallel replicas. (And Phi's biased head, split by vocabulary; GPT-2's positions.)"""
    r = results["hybrid"]
    assert len(r["ref"]) == len(PROMPTS) and all(len(t) == 12 for t in r["ref"])
    assert r["tp2"] == r["ref"] and r["compiles_after_warmup"] == 0
    assert r["pages_devices"] == 2 and r["pages_split"] == 1 and r["ssm_whole"]
    assert r["dp2"] == r["ref"]  # two replicas, each with its own state slots
    assert r["tp2_cached"][0] == r["ref"] and r["tp2_cached"][1] == 8  # the 11-token prompt's first page again
    # Nemotron 3 Super (a Mamba layer without an MLP, the MoE MLPs stacked apart, ungated latent experts): TP=2,
    # and EP over the two devices, give one device's tokens.
    assert r["nemotron"][1] == r["nemotron"][0] == r["nemotron"][2] and all(len(t) == 12 for t in r["nemotron"][0])
    assert r["qwen3_next"][1] == r["qwen3_next"][0] == r["qwen3_next"][2] and all(
        len(t) == 12 for t in r["qwen3_next"][0])  # (Qwen3-Next: gated attention heads split, DeltaNet states whole)
    for family in ("olmo_hybrid", "falcon_h1", "jamba", "lfm3", "phi", "gpt2"):
        assert r[family][1] == r[family][0] and all(len(t) == 12 for t in r[family][0]), family
    assert r["gemma4"][0] == r["gemma4"][1] == r["gemma4"][2] and all(len(t) == 12 for t in r["gemma4"][0])
    assert r["gemma4_small"][0] == r["gemma4_small"][1] and all(len(t) == 12 for t in r["gemma4_small"][0])


def test_a_draft_model_drafts_whole_on_each_device_of_a_tp2_engine(results):
    r = results["draft"]
    assert r["devices"] == [2, 2, 2] and r["pages"][0] == r["pages"][1]
    assert r["tp2"] == r["ref"] and all(len(t) == 24 for t in r["ref"])
    assert r["drafted"] > 30 and r["accepted"] == r["drafted"]
    assert r["compiles_after_warmup"] == 0


def test_an_mtp_layer_drafts_whole_on_each_device_of_a_tp2_engine(results):
    r = results["mtp"]
    assert r["devices"] == [2, 2, 2]
    assert r["tp2"] == r["ref"] and all(len(t) == 24 for t in r["ref"])
    assert r["drafted"] > 20 and r["accepted"] > 5
    assert r["compiles_after_warmup"] == 0


def test_an_eagle3_head_drafts_whole_on_each_device_of_a_tp2_engine(results):
    r = results["eagle"]
    assert r["devices"] == [2, 2, 2] and r["hidden_layers"] == [1, 3, 4]
    assert r["tp2"] == r["ref"] and all(len(t) == 24 for t in r["ref"])
    assert r["drafted"] > 20 and r["accepted"] > 5
    assert r["compiles_after_warmup"] == 0


def test_dp2_replicas_on_disjoint_devices_least_loaded_and_token_identical(results):
    r = results["dp"]
    assert r["devices"] == [[0, 1], [2, 3]]  # each replica on its own slice of the mesh
    assert r["placed"] == [0, 1, 0, 1]  # four requests at once alternate to the least-loaded replica
    assert r["dp"] == r["ref"]
    assert r["in_flight_after"] == [0, 0]
    assert r["compiles_after_warmup"] == 0
    # Each replica saw only its own requests' prompts (5 + 3 tokens, 11 + 4 tokens).
    assert r["per_replica_prompt_tokens"] == [8, 15]
    # Suffix decoding (drafts change no token): one response cache for both replicas, all four responses in it.
    assert r["suffix_shared"] and r["suffix_cached"] == 4


def test_sleep_and_weight_updates_keep_each_layout(results):
    r = results["sleep"]
    ref, new = r["ref"]
    assert r["ref_differ"] and r["tp2_devices"] == 2
    assert r["deleted"] == [True, True], "the sharded weights freed on every device"
    assert r["tp2"] == [ref, ref, ref, new, ref], "before sleeping, after levels 1 and 2, new weights, tensors"
    assert r["tp2_compiles_after_warmup"] == 0
    assert [tokens for tokens, _ in r["dp"]] == [new, new]
    assert [devices for _, devices in r["dp"]] == [[0, 1], [2, 3]], "each replica keeps its own devices"


def test_communication_model_counts_the_layout_collectives():
    from sharding.comm import step_collective_bytes

    cfg = dense_config()  # E = 64, L = 2, V = 64
    act = 16 * 64 * 4  # 16 tokens of [E] float32
    c = step_collective_bytes(cfg, tp=4, ep=1, num_tokens=16, num_logits=2)
    ring = 2 * 3 / 4
    assert c.embed == ring * act and c.attention == 2 * ring * act and c.mlp == 2 * ring * act
    assert c.lm_head == 3 / 4 * 2 * 64 * 4
    assert step_collective_bytes(cfg, tp=1, ep=1, num_tokens=16, num_logits=2).total == 0
    moe = step_collective_bytes(moe_config("qwen3_moe"), tp=1, ep=4, num_tokens=16, num_logits=2)
    # Expert parallel alone: attention is replicated, the MoE output is all-reduced over the 4 devices.
    assert moe.attention == 0 and moe.embed == 0 and moe.mlp == 2 * ring * act


def test_orbax_checkpoint_restores_into_each_layout(results):
    r = results["checkpoint"]
    for name, devices, heads in (("tp2", 2, 4), ("one", 1, 8)):
        assert r[name]["equal"] and r[name]["same_keys"]
        assert r[name]["wq_devices"] == devices and r[name]["wq_shard_heads"] == heads
    # TP=8 repeats the KV heads: the saved TP=2 weights do not fit that plan, and restore says so.
    assert "not for the planned" in r["tp8_refused"]


def test_load_model_places_hf_weights_into_their_shards(results):
    dense, moe = results["load"]["dense"], results["load"]["moe"]
    assert dense["equal"] and moe["equal"]
    assert dense["devices"] == 4 and moe["devices"] == 4
    assert dense["kv_repeat"] == 2 and dense["num_kv_heads"] == 4  # 2 KV heads widened for TP=4
    assert moe["kv_repeat"] == 1
    # Both steps know their mesh: the MoE block's experts and the attention kernels' heads split over "model".
    assert "expert_axis='expert'" in moe["layout"] and "head_axis='model'" in dense["layout"]
    # Every split parameter holds at most half of itself on any one device.
    assert dense["max_shard_fraction"] <= 0.5 and moe["max_shard_fraction"] <= 0.5


def test_quantized_weights_shard_like_their_floats(results):
    """Weights quantized at load (int8 under TP=4 with KV heads repeated; fp8 experts under EP=2 x TP=2) give one
    device's logits; values split as their weight, scales along the weight's output axes (replicated over its
    input axis); a quantized one-device model laid out over TP=2 gives one device's logits."""
    dense, moe = results["quant"]["dense"], results["quant"]["moe"]
    assert dense["rel"] < REL_TOL and moe["rel"] < REL_TOL
    assert dense["dtype"] == "int8" and moe["dtype"] == "float8_e4m3fn" and dense["kv_repeat"] == 2
    # wk [L, E, Hkv, D] over TP=4 (KV heads 2 -> 4): split by KV head, its scale [L, 1, Hkv, D] too.
    assert dense["q_spec"][:3] == ["None", "None", "model"] and dense["scale_spec"][:3] == ["None", "None", "model"]
    assert dense["scale_shape"] == [2, 1, 4, 16]
    # we_up [L, X, E, Fe]: experts over `expert`, their width over `model`; the scale [L, X, 1, Fe] alike.
    assert moe["q_spec"] == ["None", "expert", "None", "model"] and moe["scale_spec"] == moe["q_spec"]
    assert dense["laid_rel"] < REL_TOL and dense["laid_wq_spec"][:3] == ["None", "None", "model"]
    # An int8 checkpoint held as stored (its own values, no rounding) laid out over TP=4: one device's logits.
    kept = results["quant"]["kept"]
    assert kept["held"] == ["int8", "int8"] and kept["exact"] and kept["dtype"] == "int8" and kept["rel"] < REL_TOL
    assert kept["scale_spec"][:3] == ["None", "None", "model"]


def test_images_on_sharded_engines(results):
    """Images (encoded on one device, fed to every shard's step) give one device's tokens under TP and DP (LLaVA's,
    Gemma 3's spans, Qwen2.5-VL's M-RoPE offsets); the DP replicas share one embeddings cache."""
    r = results["images"]
    assert r["tp2"] == r["ref"] and r["dp"] == [r["ref"], r["ref"]]
    assert r["tp2_compiles_after_warmup"] == 0
    assert r["gemma3_tp2"] == r["gemma3_ref"] and r["gemma3_tp2_compiles_after_warmup"] == 0
    assert r["qwen_tp2"] == r["qwen_ref"] and r["qwen_tp2_compiles_after_warmup"] == 0
    assert r["dp_cache_shared"] and r["dp_stats"] == [0, 3]  # replica 1 found replica 0's images
