"""The Python arena: typed views that never alias, survive compaction, and
documented exceptions for bad input."""

import random

import pytest
import torch

import zcore

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.float64]


def fill(arena: zcore.Arena, block: zcore.Block, seed: int) -> torch.Tensor:
    """Writes a pattern unique to `seed` into the block; returns the expected bytes."""
    gen = torch.Generator().manual_seed(seed)
    expected = torch.randint(0, 256, (block.nbytes,), dtype=torch.uint8, generator=gen)
    arena.tensor(block).view(-1).view(torch.uint8).copy_(expected)
    return expected


def raw_bytes(arena: zcore.Arena, block: zcore.Block) -> torch.Tensor:
    return arena.tensor(block).reshape(-1).view(torch.uint8)


def test_views_have_the_requested_shape_dtype_and_alignment():
    arena = zcore.Arena.on_host(1 << 20)
    for dtype in DTYPES:
        block = arena.allocate((3, 5, 7), dtype)
        view = arena.tensor(block)
        assert view.shape == (3, 5, 7) and view.dtype == dtype and view.is_contiguous()
        assert view.data_ptr() % 256 == 0
    block = arena.allocate((10,), torch.float64, alignment=4096)
    assert arena.tensor(block).data_ptr() % 4096 == 0


def test_views_never_alias():
    arena = zcore.Arena.on_host(1 << 18)
    rng = random.Random(0)
    live: dict[int, tuple[zcore.Block, torch.Tensor]] = {}
    for i in range(400):
        if live and rng.random() < 0.4:
            handle = rng.choice(list(live))
            block, expected = live.pop(handle)
            assert torch.equal(raw_bytes(arena, block), expected)
            arena.free(block)
            continue
        shape = (rng.randint(1, 40), rng.randint(1, 40))
        try:
            block = arena.allocate(shape, rng.choice(DTYPES), alignment=rng.choice([1, 64, 256]))
        except zcore.OutOfArenaError:
            continue
        live[block.handle] = (block, fill(arena, block, i))
        spans = sorted(
            (arena.tensor(b).data_ptr(), arena.tensor(b).data_ptr() + b.nbytes)
            for b, _ in live.values()
        )
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    for block, expected in live.values():
        assert torch.equal(raw_bytes(arena, block), expected)


def test_data_survives_explicit_and_automatic_compaction():
    arena = zcore.Arena.on_host(4096 * 8)
    blocks = [arena.allocate((1024,), torch.float32) for _ in range(8)]
    expected = {b.handle: fill(arena, b, b.handle % 1000) for b in blocks}
    for b in blocks[::2]:
        arena.free(b)
    kept = blocks[1::2]
    assert arena.stats().largest_free == 4096

    big = arena.allocate((2048,), torch.float32)  # 8 KiB: only fits after compaction
    assert arena.generation == 1
    for b in kept:
        assert torch.equal(raw_bytes(arena, b), expected[b.handle])
    arena.tensor(big).fill_(1.0)
    for b in kept:
        assert torch.equal(raw_bytes(arena, b), expected[b.handle])

    arena.free(kept[0])
    moves = arena.defragment()
    assert moves and all(m.dst < m.src for m in moves)
    assert arena.generation == 2
    for b in kept[1:]:
        assert torch.equal(raw_bytes(arena, b), expected[b.handle])
    assert torch.all(arena.tensor(big) == 1.0)


def test_stats_follow_allocations():
    arena = zcore.Arena.on_host(1 << 16)
    a = arena.allocate((100,), torch.float32, alignment=1)
    b = arena.allocate((100,), torch.float32, alignment=1)
    s = arena.stats()
    assert (s.capacity, s.used, s.free, s.live_blocks) == (1 << 16, 800, (1 << 16) - 800, 2)
    arena.free(a)
    s = arena.stats()
    assert s.free_blocks == 2 and s.largest_free == (1 << 16) - 800
    assert s.fragmentation == pytest.approx(1 - s.largest_free / s.free)
    arena.free(b)
    assert arena.stats().peak_used == 800


def test_arena_over_a_user_tensor_writes_into_it():
    storage = torch.zeros(4096, dtype=torch.uint8)
    arena = zcore.Arena(storage)
    block = arena.allocate((4,), torch.int32)
    arena.tensor(block).copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    offset = arena.tensor(block).data_ptr() - storage.data_ptr()
    assert storage[offset : offset + 16].view(torch.int32).tolist() == [1, 2, 3, 4]


def test_out_of_arena_names_the_figures():
    arena = zcore.Arena.on_host(1024)
    arena.allocate((200,), torch.float32, alignment=1)
    with pytest.raises(zcore.OutOfArenaError, match="requested 400 bytes") as info:
        arena.allocate((100,), torch.float32, alignment=1)
    assert (info.value.requested, info.value.free, info.value.largest_free) == (400, 224, 224)
    assert isinstance(info.value, MemoryError)
    assert arena.stats().live_blocks == 1


@pytest.mark.parametrize("shape", [(0,), (3, 0), ()])
def test_empty_or_scalar_shapes(shape):
    arena = zcore.Arena.on_host(1024)
    if shape == ():
        assert arena.tensor(arena.allocate(shape, torch.float32)).shape == ()
        return
    with pytest.raises(zcore.InvalidArgumentError, match="no elements"):
        arena.allocate(shape, torch.float32)


def test_bad_input_is_refused_and_the_arena_stays_consistent():
    arena = zcore.Arena.on_host(4096)
    block = arena.allocate((8,), torch.float32)
    with pytest.raises(zcore.InvalidArgumentError, match="power of two"):
        arena.allocate((8,), torch.float32, alignment=48)
    with pytest.raises(zcore.InvalidArgumentError, match="no elements"):
        arena.allocate((-2, 3), torch.float32)
    with pytest.raises(zcore.InvalidArgumentError, match="positive"):
        zcore.Arena.on_host(0)
    with pytest.raises(zcore.InvalidArgumentError, match="uint8"):
        zcore.Arena(torch.zeros(16, dtype=torch.float32))
    with pytest.raises(zcore.InvalidArgumentError, match="contiguous"):
        zcore.Arena(torch.zeros(32, dtype=torch.uint8)[::2])

    other = zcore.Arena.on_host(4096)
    foreign = other.allocate((8,), torch.float32)
    with pytest.raises(zcore.InvalidHandleError, match="another arena"):
        arena.free(foreign)
    arena.free(block)
    with pytest.raises(zcore.InvalidHandleError, match="already freed"):
        arena.free(block)
    with pytest.raises(zcore.InvalidHandleError):
        arena.tensor(block)
    s = arena.stats()
    assert (s.used, s.live_blocks, s.largest_free) == (0, 0, 4096)
    assert other.tensor(foreign).shape == (8,)


def test_device_arena_without_cuda_raises_clearly():
    if zcore.cuda_available():
        pytest.skip("a GPU is present: see test_device_arena_keeps_data_through_compaction")
    with pytest.raises(zcore.CudaUnavailableError, match="cannot create a device arena"):
        zcore.Arena.on_device(1 << 20)
    with pytest.raises(zcore.CudaUnavailableError, match="CUDA is unavailable"):
        zcore._C.ContiguousAllocator.over_device(1 << 20, 0, 0)


@pytest.mark.cuda
def test_device_arena_keeps_data_through_compaction():
    if not zcore.cuda_available():
        pytest.skip(f"no usable GPU: {zcore.cuda_unavailable_reason()}")
    arena = zcore.Arena.on_device(64 << 20)
    small = arena.allocate((16,), torch.float32)
    # 40 MiB moving down by 256 bytes overlaps itself: exercises the staged copy.
    big = arena.allocate((10 << 20,), torch.float32)
    expected = torch.randn(10 << 20, device="cuda")
    arena.tensor(big).copy_(expected)
    arena.free(small)
    moves = arena.defragment()
    assert len(moves) == 1 and moves[0].src - moves[0].dst < moves[0].bytes
    torch.cuda.synchronize()
    assert torch.equal(arena.tensor(big), expected)
