"""Blockwise int8/int4 quantization (zcore.comm.quantization) against a reference
written here with torch ops: the same codes, scales and decoded values bit for
bit, on every SIMD level and thread count, within scale/2 per element; NaN
and Inf blocks decode to NaN; bad arguments raise with what was given and
what is needed. The CUDA tests skip with a reason where no GPU can be used."""

from __future__ import annotations

import pytest
import torch

import zcore
import zcore.optim as zo
from zcore import _C
from zcore.comm import quantization as zq

needs_gpu = pytest.mark.skipif(
    not zcore.cuda_available(), reason=f"no usable CUDA GPU: {zcore.cuda_unavailable_reason()}"
)
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ------------------------------------------------------------ the reference --


def max_code(bits: int) -> float:
    return 127.0 if bits == 8 else 7.0


def reference_quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheme of cpp/include/zcore/quantize.h in torch ops (all IEEE fp32:
    tensor-by-tensor division, torch.round is half to even)."""
    flat = x.detach().cpu().float().flatten()
    n = flat.numel()
    blocks = -(-n // block)
    rows = torch.zeros(blocks * block)
    rows[:n] = flat
    rows = rows.view(blocks, block)
    finite = torch.isfinite(rows).all(dim=1)
    amax = rows.abs().amax(dim=1)
    scales = amax / torch.full_like(amax, max_code(bits))
    scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
    coded = finite & (scales > 0)
    divisor = torch.where(coded, scales, torch.ones_like(scales))
    q = torch.round(rows / divisor[:, None]).clamp(-max_code(bits), max_code(bits))
    q = torch.where(coded[:, None], q, torch.zeros_like(q)).to(torch.int32).flatten()[:n]
    if bits == 8:
        return q.to(torch.int8), scales
    nibbles = torch.zeros(n + n % 2, dtype=torch.int32)
    nibbles[:n] = q & 0xF
    return (nibbles[0::2] | (nibbles[1::2] << 4)).to(torch.uint8), scales


def reference_codes(codes: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The signed code of each element, as int32."""
    codes = codes.cpu()
    if bits == 8:
        return codes.to(torch.int32)
    b = codes.to(torch.int32)
    nibbles = torch.stack([b & 0xF, b >> 4], dim=1).flatten()[:numel]
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)


def reference_decode(codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int) -> torch.Tensor:
    per_element = scales.cpu().repeat_interleave(block)[:numel]
    return reference_codes(codes, bits, numel).float() * per_element


def sample(numel: int, block: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Normal values whose magnitude changes from block to block (with zero
    blocks and, outside fp16's range, 1e-30 and 1e30 blocks)."""
    gen = torch.Generator().manual_seed(seed)
    wide = [1.0, 3e-3, 250.0, 0.0] + ([] if dtype == torch.float16 else [1e-30, 1e30])
    blocks = -(-numel // block)
    picks = torch.randint(len(wide), (blocks,), generator=gen)
    magnitude = torch.tensor(wide)[picks].repeat_interleave(block)[:numel]
    return (torch.randn(numel, generator=gen) * magnitude).to(dtype)


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal values, NaN where NaN (NaN payloads may differ)."""
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------ on CPU --


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("block", [2, 64, 2048])
@pytest.mark.parametrize("numel", [1, 31, 4099, 100_003])
def test_codes_scales_and_decoded_values_match_the_torch_reference(
    bits: int, dtype: torch.dtype, block: int, numel: int
) -> None:
    x = sample(numel, block, dtype, seed=numel + block)
    codes, scales = zq.quantize(x, bits, block)
    ref_codes, ref_scales = reference_quantize(x, bits, block)
    assert codes.dtype == zq.code_dtype(bits) and scales.dtype == torch.float32
    assert (codes.numel(), scales.numel()) == zq.quantized_shapes(numel, bits, block)
    assert torch.equal(codes, ref_codes)
    assert_same(scales, ref_scales)
    decoded = reference_decode(ref_codes, ref_scales, bits, block, numel)
    for out_dtype in FLOAT_DTYPES:
        assert_same(zq.dequantize(codes, scales, bits, block, numel, out_dtype), decoded.to(out_dtype))


@pytest.mark.parametrize("bits", [8, 4])
def test_each_element_is_within_half_a_scale_of_its_input(bits: int) -> None:
    block, numel = 256, 300_001
    x = sample(numel, block, torch.float32, seed=5)
    codes, scales = zq.quantize(x, bits, block)
    decoded = zq.dequantize(codes, scales, bits, block, numel)
    rows = -(-numel // block)
    error = torch.zeros(rows * block, dtype=torch.float64)
    error[:numel] = (x.double() - decoded.double()).abs()
    amax = torch.zeros(rows * block, dtype=torch.float64)
    amax[:numel] = x.double().abs()
    amax = amax.view(rows, block).amax(dim=1)
    # quantize.h: scale/2, plus the fp32 rounding of x / scale and q * scale.
    bound = scales.double() / 2 + amax * 2.0**-21 + 2.0**-142
    assert bool((error.view(rows, block).amax(dim=1) <= bound).all())
    assert bool((scales > 0).any()) and bool((scales == 0).any())


def test_half_ties_round_to_even() -> None:
    # max|x| = 127 / 8: scale 1/8, so x / scale is exactly the half-integers.
    x = torch.tensor([127 / 8, 0.5 / 8, 1.5 / 8, 2.5 / 8, -0.5 / 8, -1.5 / 8, -2.5 / 8, 3.5 / 8])
    codes, scales = zq.quantize(x, 8, 8)
    assert scales.tolist() == [0.125]
    assert codes.tolist() == [127, 0, 2, 2, 0, -2, -2, 4]


def test_int4_codes_pack_low_nibble_first() -> None:
    codes, scales = zq.quantize(torch.tensor([7.0, -1.0, 3.0, -7.0, 2.0]), 4, 4)
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [0xF7, 0x93, 0x07]  # the last high nibble pads an odd numel
    assert scales[0].item() == 1.0


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_blocks_with_nan_or_inf_decode_to_nan_and_the_others_do_not(bits: int, dtype: torch.dtype) -> None:
    x = torch.linspace(-1, 1, 40).to(dtype)
    x[3], x[9], x[21], x[39] = float("nan"), float("inf"), float("-inf"), float("nan")
    codes, scales = zq.quantize(x, bits, 8)
    nonfinite_block = torch.tensor([True, True, True, False, True])
    assert torch.equal(scales.isnan(), nonfinite_block)
    element_in_nonfinite_block = nonfinite_block.repeat_interleave(8)
    assert bool((reference_codes(codes, bits, 40)[element_in_nonfinite_block] == 0).all())
    for out_dtype in FLOAT_DTYPES:
        decoded = zq.dequantize(codes, scales, bits, 8, 40, out_dtype)
        assert torch.equal(decoded.isnan(), element_in_nonfinite_block)
    acc = zq.dequantize_add(torch.ones(40), [(codes, scales)], bits, 8)
    assert torch.equal(acc.isnan(), element_in_nonfinite_block)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [30, 512])
def test_dequantize_add_sums_the_pairs_in_order(bits: int, block: int) -> None:
    numel = 50_001
    pairs = [zq.quantize(sample(numel, block, torch.bfloat16, seed=k).clamp(-1e6, 1e6), bits, block) for k in range(4)]
    acc = torch.randn(numel, generator=torch.Generator().manual_seed(9))
    expected = acc.clone()
    for codes, scales in pairs:
        expected = expected + reference_decode(codes, scales, bits, block, numel)
    one_call = zq.dequantize_add(acc.clone(), pairs, bits, block)
    per_pair = acc.clone()
    for pair in pairs:
        zq.dequantize_add(per_pair, [pair], bits, block)
    assert torch.equal(one_call, expected)
    assert torch.equal(per_pair, expected)


def test_every_simd_level_and_thread_count_gives_the_same_bits() -> None:
    x = sample(200_003, 96, torch.float32, seed=3)
    x[7] = float("nan")
    results = []
    previous = zo.cpu_isa()
    try:
        for isa in zo.supported_cpu_isas():
            zo.set_cpu_isa(isa)
            for threads in (1, 2, 3):
                for bits in (8, 4):
                    codes, scales = zq.quantize(x, bits, 96, num_threads=threads)
                    out = zq.dequantize(codes, scales, bits, 96, x.numel(), torch.bfloat16, num_threads=threads)
                    acc = zq.dequantize_add(torch.zeros(x.numel()), [(codes, scales)] * 2, bits, 96, num_threads=threads)
                    results.append(
                        (isa, threads, bits, codes, scales.view(torch.int32), out.view(torch.int16), acc.view(torch.int32))
                    )
    finally:
        zo.set_cpu_isa(previous)
    for isa, threads, bits, *tensors in results:
        first = next(r for r in results if r[2] == bits)
        for got, expected in zip(tensors, first[3:]):
            assert torch.equal(got, expected), (isa, threads, bits)


def test_dequantize_writes_into_out_and_any_shape_is_quantized_flat() -> None:
    x = torch.randn(6, 7)
    codes, scales = zq.quantize(x, 8, 16)
    assert codes.shape == (42,) and scales.shape == (3,)
    out = torch.empty(42, dtype=torch.float16)
    assert zq.dequantize(codes, scales, 8, 16, 42, torch.float16, out=out) is out
    assert_same(out, reference_decode(codes, scales, 8, 16, 42).half())
    empty_codes, empty_scales = zq.quantize(torch.empty(0), 4, 2)
    assert empty_codes.numel() == 0 and empty_scales.numel() == 0


# ---------------------------------------------------------- bad arguments --


def test_bad_arguments_say_what_was_given_and_what_is_needed() -> None:
    x = torch.randn(64)
    codes, scales = zq.quantize(x, 8, 16)
    cases = [
        (lambda: zq.quantize(x, 3, 16), "bits=3"),
        (lambda: zq.quantize(x, 8, 0), "block=0"),
        (lambda: zq.quantize(x, 4, 15), "must be even"),
        (lambda: zq.quantize(x, 8.0, 16), "bits=8.0 must be an int"),
        (lambda: zq.quantize(torch.arange(4), 8, 2), "dtype=torch.int64"),
        (lambda: zq.quantize(torch.randn(8, 8).t(), 8, 16), "not contiguous"),
        (lambda: zq.quantize([1.0, 2.0], 8, 2), "must be a torch.Tensor"),
        (lambda: zq.quantize(torch.empty(4, device="meta"), 8, 2), "run on cpu and cuda"),
        (lambda: zq.dequantize(codes.view(torch.uint8), scales, 8, 16, 64), "8-bit codes are torch.int8"),
        (lambda: zq.dequantize(codes[:63], scales, 8, 16, 64), "has 63 elements"),
        (lambda: zq.dequantize(codes, scales[:3], 8, 16, 64), "3 elements"),
        (lambda: zq.dequantize(codes, scales.double(), 8, 16, 64), "dtype=torch.float64"),
        (lambda: zq.dequantize(codes, scales, 8, 16, 64, torch.int32), "dtype=torch.int32 is not supported"),
        (lambda: zq.dequantize(codes, scales, 8, 16, 64, out=torch.empty(64, dtype=torch.half)), "out has dtype"),
        (lambda: zq.dequantize(codes, scales, 8, 16, -1), "numel=-1"),
        (lambda: zq.dequantize_add(torch.zeros(64, dtype=torch.bfloat16), [(codes, scales)], 8, 16), "acc has dtype"),
        (lambda: zq.dequantize_add(torch.zeros(64), [codes], 8, 16), "pairs[0] must be a (codes, scales) pair"),
        (lambda: zq.dequantize_add(torch.zeros(65), [(codes, scales)], 8, 16), "65 are needed"),
    ]
    for call, fragment in cases:
        with pytest.raises(zcore.InvalidArgumentError) as info:
            call()
        assert fragment in str(info.value), (fragment, str(info.value))


def test_native_threads_out_of_range_raise() -> None:
    with pytest.raises(zcore.InvalidArgumentError, match="threads=0"):
        zq.quantize(torch.randn(4), 8, 2, num_threads=0)


# ------------------------------------------------------------------- CUDA --


@pytest.mark.skipif(zcore.cuda_available(), reason="checks the behaviour without a usable GPU")
def test_cuda_entry_points_raise_cuda_unavailable_without_a_gpu() -> None:
    fmt = _C.QuantFormat(8, 16)
    with pytest.raises(zcore.CudaUnavailableError):
        _C.cuda_quantize(fmt, 0, _C.DType.FLOAT32, 0, 0, 0, 0)
    with pytest.raises(zcore.CudaUnavailableError):
        _C.cuda_dequantize(fmt, _C.QuantizedInput(0, 0), 0, 0, _C.DType.FLOAT32, 0)
    with pytest.raises(zcore.CudaUnavailableError):
        _C.cuda_dequantize_add(fmt, [], 0, 0, 0)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("block", [2, 30, 2048])
def test_cuda_gives_the_cpu_bits(bits: int, dtype: torch.dtype, block: int) -> None:
    numel = 100_003
    x = sample(numel, block, dtype, seed=block)
    x[11] = float("inf")
    codes, scales = zq.quantize(x, bits, block)
    dev_codes, dev_scales = zq.quantize(x.cuda(), bits, block)
    assert dev_codes.is_cuda and dev_scales.is_cuda
    assert torch.equal(dev_codes.cpu(), codes)
    assert torch.equal(dev_scales.cpu().view(torch.int32), scales.view(torch.int32))
    for out_dtype in FLOAT_DTYPES:
        cpu_out = zq.dequantize(codes, scales, bits, block, numel, out_dtype)
        assert_same(zq.dequantize(dev_codes, dev_scales, bits, block, numel, out_dtype), cpu_out)
    pairs = [(codes, scales)] * 3
    acc = torch.randn(numel)
    expected = zq.dequantize_add(acc.clone(), pairs, bits, block)
    got = zq.dequantize_add(acc.cuda(), [(dev_codes, dev_scales)] * 3, bits, block)
    assert_same(got, expected)


@pytest.mark.cuda
@needs_gpu
def test_cuda_dequantize_add_takes_more_inputs_than_one_launch_holds() -> None:
    numel, block = 10_000, 64
    pairs = [zq.quantize(torch.randn(numel, generator=torch.Generator().manual_seed(k)), 8, block) for k in range(40)]
    expected = zq.dequantize_add(torch.zeros(numel), pairs, 8, block)
    got = zq.dequantize_add(torch.zeros(numel, device="cuda"), [(c.cuda(), s.cuda()) for c, s in pairs], 8, block)
    assert_same(got, expected)
