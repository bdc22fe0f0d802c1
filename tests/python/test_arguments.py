"""Each kind of argument zcore's API takes is refused alike wherever it is
passed (zcore.arguments): a dtype that is not a torch dtype (a string, a
Python type, None), an alignment that is not a positive power of two, a
shape whose size does not fit in int64. Each refusal is an
InvalidArgumentError naming the argument and what it takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zcore
from distributed import run_ranks
from zcore.checkpoint.consolidate import consolidate

NOT_DTYPES = ["float32", float, None]
NOT_ALIGNMENTS = [0, 3, -256, 48, True, 256.0, "256"]
TOO_LARGE = [(2**40, 2**40), (2**32, 2**31), (2**62, 3), (2**61,)]  # the element count or the bytes pass 2**63


def memory_apis() -> dict:
    """Every function of the host-memory and arena APIs, as (shape, dtype, alignment) -> result."""
    arena, memory = zcore.Arena.on_host(1 << 16), zcore.HostMemory(1 << 16)
    return {
        "Arena.allocate": lambda shape=(4,), dtype=torch.float32, alignment=256: arena.allocate(shape, dtype, alignment),
        "HostMemory.zeros": lambda shape=(4,), dtype=torch.float32, alignment=4096: memory.zeros(shape, dtype, alignment),
        "HostMemory.buffer": lambda shape=None, dtype=None, alignment=4096: memory.buffer(64, alignment),
    }


@pytest.mark.parametrize("value", NOT_DTYPES, ids=repr)
@pytest.mark.parametrize("api", ["Arena.allocate", "HostMemory.zeros"])
def test_a_dtype_argument_takes_only_a_torch_dtype(api: str, value) -> None:
    with pytest.raises(zcore.InvalidArgumentError, match=r"dtype must be a torch\.dtype, such as torch\.float32") as caught:
        memory_apis()[api](dtype=value)
    assert caught.value.argument == "dtype"
    if value is float or value == "float32":
        assert "did you mean torch.float32?" in str(caught.value)


@pytest.mark.parametrize("value", NOT_ALIGNMENTS, ids=repr)
@pytest.mark.parametrize("api", ["Arena.allocate", "HostMemory.zeros", "HostMemory.buffer"])
def test_an_alignment_is_a_positive_power_of_two(api: str, value) -> None:
    with pytest.raises(zcore.InvalidArgumentError, match=r"alignment must be a positive power of two") as caught:
        memory_apis()[api](alignment=value)
    assert caught.value.argument == "alignment"


@pytest.mark.parametrize("alignment", [1, 2, 4, 8, 64, 4096])
def test_every_power_of_two_is_an_alignment(alignment: int) -> None:
    """Below an element's size (arena) or a pointer's (host buffers), the place rounds it up."""
    apis = memory_apis()
    arena = zcore.Arena.on_host(1 << 16)
    block = arena.allocate((3,), torch.float64, alignment)
    assert arena.offset(block) % max(alignment, 8) == 0
    assert apis["HostMemory.zeros"](alignment=alignment).data_ptr() % alignment == 0
    apis["HostMemory.buffer"](alignment=alignment)


@pytest.mark.parametrize("shape", TOO_LARGE, ids=str)
@pytest.mark.parametrize("api", ["Arena.allocate", "HostMemory.zeros"])
def test_a_shape_too_large_to_count_is_called_too_large(api: str, shape: tuple) -> None:
    with pytest.raises(zcore.InvalidArgumentError, match=r"is too large: \d+ elements of 4 bytes are \d+ bytes"):
        memory_apis()[api](shape=shape)


@pytest.mark.parametrize("api", ["Arena.allocate", "HostMemory.zeros"])
def test_a_shape_without_elements_is_still_called_empty(api: str) -> None:
    with pytest.raises(zcore.InvalidArgumentError, match="has no elements"):
        memory_apis()[api](shape=(3, 0))


def refuses_dtypes_that_are_not_torch_dtypes(rank: int, world: int, directory: str) -> None:
    """The engine's functions that write weights in a dtype: a torch
    floating-point dtype only, checked before anything is gathered or written."""
    engine, *_ = zcore.initialize(
        model=torch.nn.Linear(4, 4),
        config={"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3}},
    )
    engine.save_checkpoint(Path(directory) / "ckpt", tag="t")
    writers = {
        "full_state_dict": lambda dtype: engine.full_state_dict(dtype),
        "save_pretrained": lambda dtype: zcore.save_pretrained(engine, Path(directory) / "hf", dtype=dtype),
        "consolidate": lambda dtype: consolidate(Path(directory) / "ckpt", Path(directory) / "out", dtype=dtype),
    }
    for name, write in writers.items():
        for value in NOT_DTYPES:
            with pytest.raises(zcore.InvalidArgumentError, match=r"dtype must be a torch\.dtype"):
                write(value)
        with pytest.raises(zcore.InvalidArgumentError, match=r"dtype=torch\.int8 is not one this takes; it takes "
                                                            r"torch\.float32"):
            write(torch.int8)
        assert not (Path(directory) / "hf").exists() and not (Path(directory) / "out").exists(), name
    assert engine.full_state_dict(torch.bfloat16)["weight"].dtype == torch.bfloat16


def test_the_engine_takes_dtypes_as_the_memory_apis_do(tmp_path: Path) -> None:
    run_ranks(refuses_dtypes_that_are_not_torch_dtypes, 1, str(tmp_path), launcher=False)
