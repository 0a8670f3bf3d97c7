"""Reading a `pytorch_model.bin` (the zip archive `torch.save` writes) without torch: its tensors as numpy arrays.

The archive holds a pickle of the state dict (`<name>/data.pkl`) whose tensors refer to raw storages
(`<name>/data/<key>`). The pickle is read by an unpickler that builds nothing but tensors, storages and the dict
holding them (anything else it names is refused), so a file cannot run code when read. EAGLE heads are released in
this form (`engine.eagle`)."""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve.loader.keymap import CheckpointError

_STORAGES = {"FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": ml_dtypes.bfloat16,
             "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
             "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


class _StorageType:
    def __init__(self, name: str):
        self.dtype = np.dtype(_STORAGES[name])


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple, stride: tuple, *_: Any) -> np.ndarray:
    """`torch._utils._rebuild_tensor_v2`: the tensor's elements of its storage (a copy, laid out C-contiguous)."""
    if not size:
        return np.array(storage[offset])
    end = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True) if n > 0)
    if min(size) > 0 and (offset < 0 or end > storage.size):
        raise CheckpointError(f"a tensor of shape {tuple(size)} lies past its storage of {storage.size} elements")
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=size,
                                           strides=[s * storage.itemsize for s in stride], writeable=False)
    return np.ascontiguousarray(view)


def _rebuild_parameter(data: np.ndarray, *_: Any) -> np.ndarray:
    """`torch._utils._rebuild_parameter`: a parameter's data."""
    return data


_CLASSES = {("collections", "OrderedDict"): collections.OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, archive: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self.archive, self.prefix, self.storages = archive, prefix, {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        if (module, name) in _CLASSES:
            return _CLASSES[module, name]
        raise CheckpointError(f"the PyTorch file names {module}.{name}, which is not part of a state dict of tensors "
                              "(refused: reading it could run code)")

    def persistent_load(self, pid: Any) -> np.ndarray:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise CheckpointError(f"the PyTorch file refers to {pid!r}, which is not a tensor's storage")
        _, kind, key, _location, _numel = pid
        if key not in self.storages:
            data = self.archive.read(f"{self.prefix}/data/{key}")
            self.storages[key] = np.frombuffer(data, kind.dtype)
        return self.storages[key]


def read_torch_file(path: str) -> dict[str, np.ndarray]:
    """The tensors of the state dict `torch.save` wrote to `path` (zip format), by name, as numpy arrays."""
    state = _read(path, path)
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return dict(state)


def read_torch_tensor(data: bytes, what: str = "the data") -> np.ndarray:
    """The one tensor `torch.save` wrote into `data` (a client's serialized tensor, e.g. vLLM's `prompt_embeds`)."""
    tensor = _read(io.BytesIO(data), what)
    if not isinstance(tensor, np.ndarray):
        raise CheckpointError(f"{what} holds a {type(tensor).__name__}, not one tensor")
    return tensor


def _read(source: Any, path: str) -> Any:
    """The object (tensors, storages, dicts only) `torch.save` wrote to `source`, a path or a file."""
    if not zipfile.is_zipfile(source):
        raise CheckpointError(f"{path} is not a PyTorch zip archive (the format torch.save writes since torch 1.6); "
                              "convert it to safetensors")
    with zipfile.ZipFile(source) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise CheckpointError(f"{path} holds {len(pickles)} data.pkl records, expected one")
        prefix = pickles[0][: -len("/data.pkl")]
        with archive.open(pickles[0]) as f:
            try:
                state = _Unpickler(f, archive, prefix).load()
            except (pickle.UnpicklingError, EOFError, KeyError, ValueError) as e:
                if isinstance(e, CheckpointError):
                    raise
                raise CheckpointError(f"cannot read {path}: {e}") from e
    return state
