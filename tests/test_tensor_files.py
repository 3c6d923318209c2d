"""Checkpoint files written with the GIL released for their bytes: safetensors' own loader reads them back bit for bit,
and a nested optimizer state comes back with its structure, types and values."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from astraflow.train import tensor_files
from astraflow.train.tensor_files import read_state, write_safetensors, write_state


def test_safetensors_loads_what_is_written_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(33, 7, generator=g),
        "half": torch.randn(5, generator=g).half(),
        "bf": torch.randn(3, 4, generator=g).bfloat16(),
        "step": torch.tensor(12.0),  # 0-dimensional
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(-5, 5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(0, 256, dtype=torch.uint8),
        "strided": torch.randn(6, 8, generator=g)[:, ::2],  # not contiguous
        "nan": torch.tensor([math.nan, -0.0, math.inf]),
    }
    path = tmp_path / "x.safetensors"
    write_safetensors(tensors, path, metadata={"lm_head.weight": "model.embed_tokens.weight"})
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"lm_head.weight": "model.embed_tokens.weight"}
    assert (8 + int.from_bytes(path.read_bytes()[:8], "little")) % 8 == 0  # the data starts aligned


def test_what_cannot_be_written_is_refused_with_the_tensor_named(tmp_path):
    with pytest.raises(ValueError, match="'c'.*complex"):
        write_safetensors({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "x")
    with pytest.raises(ValueError, match="'m' is on meta"):
        write_safetensors({"m": torch.zeros(2, device="meta")}, tmp_path / "x")
    with pytest.raises(TypeError, match="state.0: cannot store a set"):
        write_state({"state": [{1, 2}]}, tmp_path / "x")
    with pytest.raises(TypeError, match="a key of type float"):
        write_state({0.5: 1}, tmp_path / "x")


def test_a_nested_state_comes_back_with_its_structure_types_and_values(tmp_path):
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 2)}, 7: {"step": torch.tensor(1.0), "buf": None}},
        "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0, 7], "name": "all",
                          "foreach": None, "amsgrad": False, "clip": math.inf}],
    }
    path = tmp_path / "opt.safetensors"
    write_state(state, path)
    back = read_state(path)
    assert back["param_groups"] == state["param_groups"] and isinstance(back["param_groups"][0]["betas"], tuple)
    assert list(back["state"]) == [0, 7] and back["state"][7]["buf"] is None
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert back["state"][0]["step"].shape == () and float(back["state"][0]["step"]) == 3.0
    with safe_open(str(path), framework="pt") as f:  # the structure is plain JSON in the metadata
        assert json.loads(f.metadata()["state"])["dict"][0][0] == "state"
    write_safetensors({"w": torch.zeros(1)}, tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="not written by write_state"):
        read_state(tmp_path / "plain.safetensors")


def test_more_tensors_than_one_writev_takes_and_short_writes_still_write_every_byte(tmp_path, monkeypatch):
    """Past ``IOV_MAX`` buffers the write takes several calls; a call that writes less than it was given (as the kernel
    may) resumes mid-buffer: the file is the same as one written a byte string at a time."""
    tensors = {f"t{i}": torch.arange(i % 7, dtype=torch.int32) + i for i in range(tensor_files.IOV_MAX + 300)}
    whole = tmp_path / "whole.safetensors"
    write_safetensors(tensors, whole)
    back = load_file(str(whole))
    assert all(torch.equal(back[k], t) for k, t in tensors.items())

    real, calls = os.writev, []

    def short(fd, buffers):  # at most 997 bytes a call, cut mid-buffer
        calls.append(len(buffers))
        assert len(buffers) <= tensor_files.IOV_MAX
        out = b""
        for b in buffers:
            out += bytes(b[: 997 - len(out)])
            if len(out) == 997:
                break
        return real(fd, [out])

    monkeypatch.setattr(os, "writev", short)
    cut = tmp_path / "cut.safetensors"
    write_safetensors(tensors, cut)
    assert cut.read_bytes() == whole.read_bytes() and len(calls) > 50
