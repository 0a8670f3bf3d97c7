"""`--converted-checkpoint-dir`: the first start converts the checkpoint and saves the result; a second
start restores identical parameters without calling the converter, on one device and at TP=2 (two
simulated CPU devices, in a child process); a directory made for another model is refused."""

from __future__ import annotations

import json
import logging
import os
import sys

import numpy as np
import pytest

from tests.test_sharding_worker import RESULT_PREFIX, dense_config, run_module


def _export(path: str, cfg, seed: int = 0) -> str:
    import jax

    from jaxserve.loader.export import export_hf
    from jaxserve.models.params import init_params
    from tests.fake_model import fake_tokenizer

    export_hf(path, cfg, init_params(cfg, jax.random.PRNGKey(seed), scale=0.1), fake_tokenizer())
    return path


def _spy_converter(monkeypatch, allow: bool) -> list[str]:
    """Record calls to the converter that `load_model` uses; with `allow` False a call fails the load."""
    from jaxserve.engine import model_loading

    calls: list[str] = []
    real = model_loading.load_params

    def spy(ckpt, *args, **kwargs):
        calls.append(type(ckpt).__name__)
        if not allow:
            raise AssertionError("the converter ran although converted weights were saved")
        return real(ckpt, *args, **kwargs)

    monkeypatch.setattr(model_loading, "load_params", spy)
    return calls


def _leaves(params) -> dict[str, np.ndarray]:
    from jaxserve.models.params import param_paths

    return {k: np.asarray(v) for k, v in param_paths(params).items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _export(str(tmp_path_factory.mktemp("tiny-hf")), dense_config())


def test_first_start_saves_and_second_restores_without_converting(model_dir, tmp_path, monkeypatch, caplog):
    from jaxserve.engine.model_loading import load_model
    from jaxserve.engine_args import EngineArgs
    from sharding.checkpoint import CONFIG_FILE, PARAMS_DIR

    conv = str(tmp_path / "converted")
    args = EngineArgs(model=model_dir, dtype="float32", converted_checkpoint_dir=conv)
    calls = _spy_converter(monkeypatch, allow=True)
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.model_loading"):
        first = load_model(args, progress=False)
    assert calls == ["HFDirectory"]
    assert os.path.isfile(os.path.join(conv, CONFIG_FILE)) and os.path.isdir(os.path.join(conv, PARAMS_DIR))
    assert "converted" in caplog.text and "saved the converted weights" in caplog.text
    caplog.clear()

    calls = _spy_converter(monkeypatch, allow=False)
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.model_loading"):
        second = load_model(args, progress=False)
    assert calls == []
    assert "restored converted weights" in caplog.text and "conversion of" in caplog.text
    want, got = _leaves(first.params), _leaves(second.params)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    assert second.config == first.config and second.tokenizer.vocab_size == first.tokenizer.vocab_size


def test_directory_for_another_model_dtype_or_source_is_refused(model_dir, tmp_path, monkeypatch):
    import dataclasses

    from jaxserve.engine.model_loading import load_model
    from jaxserve.engine_args import EngineArgs
    from sharding.checkpoint import ConvertedCheckpointMismatch

    conv = str(tmp_path / "converted")
    load_model(EngineArgs(model=model_dir, dtype="float32", converted_checkpoint_dir=conv), progress=False)
    _spy_converter(monkeypatch, allow=False)
    deeper = _export(str(tmp_path / "deeper"), dataclasses.replace(dense_config(), num_layers=3))
    with pytest.raises(ConvertedCheckpointMismatch, match=r"another model config.*num_layers=2 \(needed 3\)"):
        load_model(EngineArgs(model=deeper, dtype="float32", converted_checkpoint_dir=conv), progress=False)
    with pytest.raises(ConvertedCheckpointMismatch, match="holds float32 parameters, this start needs bfloat16"):
        load_model(EngineArgs(model=model_dir, dtype="bfloat16", converted_checkpoint_dir=conv), progress=False)
    # Same architecture, other weights (a fine-tune, say): the config alone cannot tell them apart.
    other = _export(str(tmp_path / "finetune"), dense_config(), seed=1)
    with pytest.raises(ConvertedCheckpointMismatch, match="was converted from"):
        load_model(EngineArgs(model=other, dtype="float32", converted_checkpoint_dir=conv), progress=False)


def test_flag_reaches_engine_args():
    import argparse

    from jaxserve.engine_args import EngineArgs

    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--converted-checkpoint-dir", "/x/y"])
    assert EngineArgs.from_cli_args(ns).converted_checkpoint_dir == "/x/y"
    assert EngineArgs().converted_checkpoint_dir is None


def test_tp2_saves_shards_and_restores_them_without_converting(tmp_path):
    r = run_module("tests.test_converted_checkpoint", str(tmp_path), devices=2, timeout=120)
    assert r["first_calls"] == 1 and r["second_calls"] == 0
    assert r["equal"] and r["same_keys"]
    # Restored straight into the TP=2 layout: each device holds half of the 8 query heads.
    assert r["wq_devices"] == 2 and r["wq_shard_heads"] == 4
    # One KV head at TP=2 is saved repeated (2 heads); a one-device start cannot use that directory.
    assert r["kv1_saved_kv_heads"] == 2
    assert "num_kv_heads=2 (needed 1)" in r["kv1_one_device_refused"]


def _child(tmp: str) -> dict:
    """TP=2 on two simulated devices: save on the first load, restore on the second (converter forbidden)."""
    import dataclasses

    from jaxserve.engine import model_loading
    from jaxserve.engine_args import EngineArgs
    from sharding.checkpoint import ConvertedCheckpointMismatch, saved_config

    calls = []
    real = model_loading.load_params

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    model_loading.load_params = spy
    model = _export(os.path.join(tmp, "model"), dense_config())
    args = EngineArgs(model=model, dtype="float32", tensor_parallel_size=2,
                      converted_checkpoint_dir=os.path.join(tmp, "converted"))
    first = model_loading.load_model(args, progress=False)
    found = {"first_calls": len(calls)}
    second = model_loading.load_model(args, progress=False)
    found["second_calls"] = len(calls) - found["first_calls"]
    want, got = _leaves(first.params), _leaves(second.params)
    wq = second.params.layers.wq
    found.update(equal=all(np.array_equal(got[k], want[k]) for k in want), same_keys=sorted(got) == sorted(want),
                 wq_devices=len(wq.sharding.device_set), wq_shard_heads=wq.addressable_shards[0].data.shape[2])

    kv1 = _export(os.path.join(tmp, "kv1"), dataclasses.replace(dense_config(), num_kv_heads=1))
    conv = os.path.join(tmp, "kv1-converted")
    model_loading.load_model(args.replace(model=kv1, converted_checkpoint_dir=conv), progress=False)
    found["kv1_saved_kv_heads"] = saved_config(conv).num_kv_heads
    try:
        model_loading.load_model(args.replace(model=kv1, converted_checkpoint_dir=conv, tensor_parallel_size=1),
                                 progress=False)
        found["kv1_one_device_refused"] = ""
    except ConvertedCheckpointMismatch as e:
        found["kv1_one_device_refused"] = str(e)
    return found


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(_child(sys.argv[1])), flush=True)
