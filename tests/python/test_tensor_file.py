"""zcore's streaming safetensors files: readable by the safetensors library
(the independent reference), and every byte verified when zcore reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from zcore.checkpoint.tensor_file import TensorFileReader, TensorFileWriter, TensorSpec, plan_files
from zcore.errors import CheckpointCorruptError

TENSORS = {
    "w": torch.randn(3, 5),
    "half": torch.randn(7).to(torch.bfloat16),
    "f16": torch.randn(2, 2).to(torch.float16),
    "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "mask": torch.tensor([True, False, True]),
    "bytes": torch.arange(5, dtype=torch.uint8),
}


def write(path: Path, tensors: dict[str, torch.Tensor]):
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    with TensorFileWriter(path, specs) as writer:
        for value in tensors.values():
            writer.write(value)
        return writer.commit()


def test_files_are_safetensors(tmp_path: Path) -> None:
    record = write(tmp_path / "a.safetensors", TENSORS)
    loaded = load_file(tmp_path / "a.safetensors")
    assert loaded.keys() == TENSORS.keys()
    for k, v in TENSORS.items():
        assert torch.equal(loaded[k], v), k
    with safe_open(tmp_path / "a.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert record.nbytes == (tmp_path / "a.safetensors").stat().st_size
    assert not list(tmp_path.glob(".*.tmp"))


def test_reader_round_trip_into_given_memory(tmp_path: Path) -> None:
    record = write(tmp_path / "a.safetensors", TENSORS)
    with TensorFileReader(tmp_path / "a.safetensors", record) as reader:
        for k, v in TENSORS.items():
            assert torch.equal(reader.read(k), v), k
        out = torch.zeros(20)
        reader.read("w", out=out[5:20])
        assert torch.equal(out[5:], TENSORS["w"].reshape(-1)) and not out[:5].any()


@pytest.mark.parametrize("position", ["data", "header", "truncated"])
def test_damage_is_detected_naming_file_and_tensor(tmp_path: Path, position: str) -> None:
    path = tmp_path / "a.safetensors"
    record = write(path, TENSORS)
    data = bytearray(path.read_bytes())
    if position == "data":
        data[-20] ^= 0x10  # inside "ids"
    elif position == "header":
        data[30] ^= 0x01
    else:
        del data[-3:]
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="a.safetensors") as info:
        with TensorFileReader(path, record) as reader:
            for k in TENSORS:
                reader.read(k)
    if position == "data":
        assert "fails the checksum of tensor" in str(info.value)


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    specs = [TensorSpec("a", torch.float32, (4,)), TensorSpec("b", torch.float32, (4,))]
    with pytest.raises(ValueError, match="should be torch.float32 of shape"):
        with TensorFileWriter(tmp_path / "x.safetensors", specs) as writer:
            writer.write(torch.zeros(4))
            writer.write(torch.zeros(5))
    assert not list(tmp_path.iterdir())


def test_files_split_at_the_maximum_size() -> None:
    specs = [TensorSpec(str(i), torch.float32, (n,)) for i, n in enumerate([10, 10, 30, 5, 5, 1])]
    files = plan_files(specs, max_bytes=80)  # 40, 40, 120, 20, 20, 4 bytes
    assert [[s.name for s in f] for f in files] == [["0", "1"], ["2"], ["3", "4", "5"]]
