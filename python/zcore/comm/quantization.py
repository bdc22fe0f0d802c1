"""Blockwise int8/int4 quantization of flat buffers, for quantized collectives
(ZeRO++: qwZ weights, qgZ gradients).

A buffer of ``numel`` elements is cut into blocks of ``block`` elements (the
last one may be partial), each with one fp32 scale ``max|x| / 127`` (8 bits)
or ``max|x| / 7`` (4 bits) and one code per element, ``round_half_even(x /
scale)``. 8-bit codes are an int8 tensor of ``numel`` elements; 4-bit codes
are packed two per byte (low nibble first) into a uint8 tensor of
``ceil(numel / 2)`` elements, and ``block`` must be even. A block of zeros has
scale 0; a block holding NaN or Inf has scale NaN and decodes to NaN, so an
overflow check downstream still sees it. Each element decodes to within
``scale / 2`` of its input (plus fp32 and output-dtype rounding); the exact
contract is in ``cpp/include/zcore/quantize.h``.

CPU tensors run on the native SIMD kernels with ``num_threads`` threads
(default ``torch.get_num_threads()``), with the same bits on every SIMD level;
CUDA tensors run on the current stream of their device, with the same bits as
the CPU (NaN payloads aside).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import zcore._C as _C
from zcore.errors import InvalidArgumentError
from zcore.memory.kernel_tensors import NATIVE_DTYPES, check_tensor, dtype_names, kernel_device

__all__ = ["code_dtype", "dequantize", "dequantize_add", "quantize", "quantized_shapes"]

_FLOAT_DTYPES = tuple(NATIVE_DTYPES)


def code_dtype(bits: int) -> torch.dtype:
    """The dtype of the codes: int8 for 8 bits, uint8 (two packed codes) for 4."""
    return torch.int8 if bits == 8 else torch.uint8


def quantized_shapes(numel: int, bits: int, block: int) -> tuple[int, int]:
    """``(code elements, scales)`` for ``numel`` elements; raises
    :class:`zcore.InvalidArgumentError` for a bad ``bits``/``block``."""
    fmt = _format(bits, block)
    return _C.quantized_bytes(fmt, numel), _C.scale_count(fmt, numel)


def quantize(
    x: torch.Tensor, bits: int, block: int, *, num_threads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes every element of ``x`` (fp32, bf16 or fp16, contiguous, any
    shape, CPU or CUDA): returns ``(codes, scales)``, flat, on ``x``'s device."""
    fmt = _format(bits, block)
    x = check_tensor(x, "x", _FLOAT_DTYPES, kernel_device(x, "x"))
    numel = x.numel()
    codes = torch.empty(_C.quantized_bytes(fmt, numel), dtype=code_dtype(bits), device=x.device)
    scales = torch.empty(_C.scale_count(fmt, numel), dtype=torch.float32, device=x.device)
    args = (fmt, x.data_ptr(), NATIVE_DTYPES[x.dtype], numel, codes.data_ptr(), scales.data_ptr())
    if x.device.type == "cpu":
        _C.quantize(*args, _threads(num_threads))
    else:
        with torch.cuda.device(x.device):
            _C.cuda_quantize(*args, torch.cuda.current_stream(x.device).cuda_stream)
    return codes, scales


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    numel: int,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    *,
    num_threads: int | None = None,
) -> torch.Tensor:
    """Decodes ``numel`` elements into ``out`` (contiguous, ``numel``
    elements, of ``dtype``), or into a new flat tensor of ``dtype``, on the
    device of ``q``; returns it."""
    fmt = _format(bits, block)
    if dtype not in _FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"dtype={dtype} is not supported; decode to one of: {dtype_names(_FLOAT_DTYPES)}", dtype=str(dtype)
        )
    device = kernel_device(q, "q")
    source = _check_quantized(q, scales, fmt, numel, device, "q", "scales")
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=device)
    else:
        check_tensor(out, "out", (dtype,), device, numel)
    args = (fmt, source, numel, out.data_ptr(), NATIVE_DTYPES[dtype])
    if device.type == "cpu":
        _C.dequantize(*args, _threads(num_threads))
    else:
        with torch.cuda.device(device):
            _C.cuda_dequantize(*args, torch.cuda.current_stream(device).cuda_stream)
    return out


def dequantize_add(
    acc: torch.Tensor,
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    bits: int,
    block: int,
    *,
    num_threads: int | None = None,
) -> torch.Tensor:
    """Adds each decoded ``(codes, scales)`` pair of ``pairs``, in order, into
    ``acc`` (fp32, contiguous; its ``numel`` is that of every pair) and
    returns ``acc``: the reduce side of a quantized reduce-scatter. Same bits
    as ``acc += dequantize(...)`` once per pair, with ``acc`` read once."""
    fmt = _format(bits, block)
    device = kernel_device(acc, "acc")
    check_tensor(acc, "acc", (torch.float32,), device)
    numel = acc.numel()
    inputs = []
    for k, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidArgumentError(
                f"pairs[{k}] must be a (codes, scales) pair, got {type(pair).__name__}", index=k
            )
        inputs.append(_check_quantized(pair[0], pair[1], fmt, numel, device, f"pairs[{k}][0]", f"pairs[{k}][1]"))
    if device.type == "cpu":
        _C.dequantize_add(fmt, inputs, numel, acc.data_ptr(), _threads(num_threads))
    else:
        with torch.cuda.device(device):
            _C.cuda_dequantize_add(fmt, inputs, numel, acc.data_ptr(), torch.cuda.current_stream(device).cuda_stream)
    return acc


def _format(bits: int, block: int) -> _C.QuantFormat:
    for name, value in (("bits", bits), ("block", block)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{name}={value!r} must be an int", name=name)
    fmt = _C.QuantFormat(bits, block)
    _C.check_quant_format(fmt)
    return fmt


def _check_quantized(
    codes: object,
    scales: object,
    fmt: _C.QuantFormat,
    numel: int,
    device: torch.device,
    codes_name: str,
    scales_name: str,
) -> _C.QuantizedInput:
    """The native view of ``(codes, scales)`` holding ``numel`` elements in ``fmt``."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise InvalidArgumentError(f"numel={numel!r} must be an int >= 0", numel=numel)
    if isinstance(codes, torch.Tensor) and codes.dtype != code_dtype(fmt.bits):
        raise InvalidArgumentError(
            f"{codes_name} has dtype={codes.dtype}; {fmt.bits}-bit codes are {code_dtype(fmt.bits)} "
            "(int8 for 8 bits, uint8 holding two codes per byte for 4 bits)",
            name=codes_name,
            dtype=str(codes.dtype),
        )
    check_tensor(codes, codes_name, (code_dtype(fmt.bits),), device, _C.quantized_bytes(fmt, numel))
    check_tensor(scales, scales_name, (torch.float32,), device, _C.scale_count(fmt, numel))
    return _C.QuantizedInput(codes.data_ptr(), scales.data_ptr())


def _threads(num_threads: int | None) -> int:
    return torch.get_num_threads() if num_threads is None else int(num_threads)
