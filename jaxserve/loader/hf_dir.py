"""Reading an HF model directory: `config.json` and `*.safetensors` (a sharded index included)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loader.keymap import CheckpointError
from jaxserve.quantization import dequantized_tensors, parse_quantization


class HFDirectory:
    """An HF-format model directory opened for reading."""

    def __init__(self, path: str | os.PathLike, weights: bool = True, overrides: Mapping[str, Any] | None = None):
        """`weights=False` reads the config alone (a directory with no weight files is then accepted);
        `overrides` replace keys of its config.json (`--hf-overrides`)."""
        self.path = os.fspath(path)
        config_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"no config.json in {self.path}")
        with open(config_path) as f:
            self.hf_config = {**json.load(f), **(overrides or {})}
        self.files = self._weight_files() if weights else []

    def _weight_files(self) -> list[str]:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not os.path.isfile(os.path.join(self.path, f))]
            if missing:
                raise FileNotFoundError(f"safetensors index names missing shard(s) {missing} in {self.path}")
            return [os.path.join(self.path, f) for f in files]
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {self.path} (only safetensors are supported)")
        return [os.path.join(self.path, f) for f in files]

    def config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)

    def tensor_names(self) -> list[str]:
        from safetensors import safe_open

        names = []
        for file in self.files:
            with safe_open(file, framework="numpy") as f:
                names.extend(f.keys())
        return names

    def tensors(self, cfg: ModelConfig, select: Callable[[str], bool] | None = None,
                keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (HF name, float32 array) one tensor at a time (bfloat16 files included); the quantized weights
        its `quantization_config` describes come dequantized (`jaxserve.quantization`), or as stored with their
        scales for the modules `keep` accepts. `select`: only the tensors whose names it accepts (and their
        scales) are read."""
        quant = parse_quantization(self.hf_config.get("quantization_config"))
        if quant is None:
            for name, array in self._stored_tensors(select):
                yield name, array.astype(np.float32, copy=False)
            return
        try:
            yield from dequantized_tensors(self._stored_tensors(select), quant, keep)
        except ValueError as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(str(e)) from e

    def stored_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, array in its stored dtype: integer ones too), one tensor at a time."""
        return self._stored_tensors()

    def _stored_tensors(self, select: Callable[[str], bool] | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, array in its stored dtype), one tensor at a time; with `select`, those it accepts."""
        from safetensors import safe_open

        for file in self.files:
            try:
                with safe_open(file, framework="numpy") as f:
                    header = None
                    for name in f.keys():
                        if select is not None and not select(name):
                            continue
                        if f.get_slice(name).get_dtype() not in _FLOAT8:
                            yield name, f.get_tensor(name)
                            continue
                        header = header or _Header(file)
                        yield name, header.float8(name)
            except (OSError, ValueError) as e:
                if isinstance(e, CheckpointError):
                    raise
                raise CheckpointError(f"cannot read {file}: {e}") from e


_FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


class _Header:
    """A safetensors file's header (read once) and its data memory-mapped: the float8 tensors, which safetensors'
    numpy reader does not return, as ml_dtypes' float8."""

    def __init__(self, file: str):
        with open(file, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            self.entries = json.loads(fh.read(size))
        self.data = np.memmap(file, np.uint8, mode="r", offset=8 + size)

    def float8(self, name: str) -> np.ndarray:
        info = self.entries[name]
        start, end = info["data_offsets"]
        return self.data[start:end].view(_FLOAT8[info["dtype"]]).reshape(info["shape"])
