"""Reading `torch.save`'s zip archives without torch (`loader.torch_bin`): every dtype a state dict holds, views into
shared storages (offsets, strides), scalars and empty tensors, parameters; what is not a state dict of tensors is
refused without being run."""

from __future__ import annotations

import collections

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxserve.loader.keymap import CheckpointError  # noqa: E402
from jaxserve.loader.torch_bin import read_torch_file  # noqa: E402


def test_tensors_read_as_torch_holds_them(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    state = collections.OrderedDict(
        f32=torch.randn(3, 4, generator=g), f16=torch.randn(7, generator=g).half(),
        bf16=torch.randn(2, 3, generator=g).bfloat16(), f64=torch.randn(2, generator=g).double(),
        i64=torch.arange(-5, 5), i32=torch.arange(4, dtype=torch.int32), i8=torch.tensor([-3, 4], dtype=torch.int8),
        u8=torch.tensor([200, 1], dtype=torch.uint8), b=torch.tensor([True, False, True]),
        transposed=base.t(), rows=base[2:5], column=base[:, 3], scalar=torch.tensor(2.5), empty=torch.zeros(0, 3),
        param=torch.nn.Parameter(torch.randn(2, 2, generator=g)))
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    got = read_torch_file(str(path))
    assert list(got) == list(state)
    for name, t in state.items():
        want = t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()
        assert got[name].shape == tuple(t.shape), name
        assert str(got[name].dtype) == {"torch.bfloat16": "bfloat16"}.get(str(t.dtype), str(want.dtype)), name
        np.testing.assert_array_equal(np.asarray(got[name], want.dtype), want, err_msg=name)


def test_what_is_not_a_state_dict_of_tensors_is_refused(tmp_path):
    path = tmp_path / "other.bin"
    torch.save({"w": torch.ones(2), "count": collections.Counter("ab")}, path)
    with pytest.raises(CheckpointError, match="names collections.Counter, which is not part of a state dict"):
        read_torch_file(str(path))
    legacy = tmp_path / "legacy.bin"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="is not a PyTorch zip archive"):
        read_torch_file(str(legacy))
    torch.save([torch.ones(2)], tmp_path / "list.bin")
    with pytest.raises(CheckpointError, match="does not hold a state dict of tensors"):
        read_torch_file(str(tmp_path / "list.bin"))
