"""Type stub for zcore's native core (zcore._C)."""

import enum


# allocator
class Move:
    src: int
    dst: int
    bytes: int

class BlockInfo:
    offset: int
    bytes: int
    handle: int

class AllocatorStats:
    capacity: int
    used: int
    free: int
    largest_free: int
    live_blocks: int
    free_blocks: int
    fragmentation: float
    peak_used: int
    allocations: int
    defragmentations: int
    bytes_moved: int

class ContiguousAllocator:
    def __init__(self, capacity: int) -> None: ...
    @staticmethod
    def over_host(capacity: int, base: int) -> ContiguousAllocator: ...
    @staticmethod
    def over_device(capacity: int, base: int, stream: int) -> ContiguousAllocator: ...
    def allocate(self, bytes: int, alignment: int) -> int: ...
    def free(self, handle: int) -> None: ...
    def offset(self, handle: int) -> int: ...
    def size(self, handle: int) -> int: ...
    def defragment(self) -> list[Move]: ...
    def stats(self) -> AllocatorStats: ...
    def blocks(self) -> list[BlockInfo]: ...
    @property
    def generation(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def moves_bytes(self) -> bool: ...

# host memory
class LockPolicy:
    NONE: LockPolicy
    TRY: LockPolicy
    REQUIRE: LockPolicy

class HostMemoryStats:
    budget: int
    used: int
    locked: int
    peak: int

class HostBuffer:
    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def locked(self) -> bool: ...
    def __buffer__(self, flags: int) -> memoryview: ...

class HostMemory:
    def __init__(self, budget: int, lock: LockPolicy) -> None: ...
    def allocate(self, bytes: int, alignment: int) -> HostBuffer: ...
    def stats(self) -> HostMemoryStats: ...
    @property
    def lock_policy(self) -> LockPolicy: ...

# build and CUDA
def io_backend() -> str: ...
def compiler() -> str: ...
def cuda_built() -> bool: ...
def cuda_device_count() -> int: ...
def cuda_unavailable_reason() -> str: ...


# element types of the kernels' buffers (cpp/include/zcore/dtype.h)

class DType(enum.Enum):
    FLOAT32 = 0
    BFLOAT16 = 1
    FLOAT16 = 2


# quantization (format and special blocks: cpp/include/zcore/quantize.h)

class QuantFormat:
    def __init__(self, bits: int, block: int) -> None: ...
    @property
    def bits(self) -> int: ...
    @property
    def block(self) -> int: ...

class QuantizedInput:
    def __init__(self, codes: int, scales: int) -> None: ...

def check_quant_format(format: QuantFormat) -> None: ...
def quantized_bytes(format: QuantFormat, numel: int) -> int: ...
def scale_count(format: QuantFormat, numel: int) -> int: ...
def quantize(
    format: QuantFormat, input: int, input_dtype: DType, numel: int, codes: int, scales: int, threads: int
) -> None: ...
def dequantize(
    format: QuantFormat, input: QuantizedInput, numel: int, output: int, output_dtype: DType, threads: int
) -> None: ...
def dequantize_add(format: QuantFormat, inputs: list[QuantizedInput], numel: int, acc: int, threads: int) -> None: ...
def cuda_quantize(
    format: QuantFormat, input: int, input_dtype: DType, numel: int, codes: int, scales: int, stream: int
) -> None: ...
def cuda_dequantize(
    format: QuantFormat, input: QuantizedInput, numel: int, output: int, output_dtype: DType, stream: int
) -> None: ...
def cuda_dequantize_add(
    format: QuantFormat, inputs: list[QuantizedInput], numel: int, acc: int, stream: int
) -> None: ...


# ZeRO-3 parameter coordinator (protocol: cpp/include/zcore/coordinator.h)

class GroupState(enum.Enum):
    SHARDED = 0
    GATHERING = 1
    GATHERED = 2
    IN_USE = 3

class Action(enum.Enum):
    GATHER = 0
    WAIT = 1
    RELEASE = 2
    FETCH_SHARD = 3
    SHARD_READY = 4
    DROP_SHARD = 5
    STORE_SHARD = 6
    SHARD_STORED = 7

class ShardTier(enum.Enum):
    DEVICE = 0
    HOST = 1
    NVME = 2

class ShardState(enum.Enum):
    RESIDENT = 0
    STORED = 1
    FETCHING = 2
    FETCHED = 3
    STORING = 4

Plan = list[tuple[Action, int]]

class CoordinatorConfig:
    prefetch_bucket_elements: int
    max_live_elements: int
    max_reuse_distance: int
    persistence_threshold: int
    resync_window: int
    staging_bytes: int
    fetch_horizon_uses: int
    nvme_host_elements: int
    def __init__(
        self,
        *,
        prefetch_bucket_elements: int = 50_000_000,
        max_live_elements: int = 1_000_000_000,
        max_reuse_distance: int = 1_000_000_000,
        persistence_threshold: int = 100_000,
        resync_window: int = 64,
        staging_bytes: int = 0,
        fetch_horizon_uses: int = 64,
        nvme_host_elements: int = 0,
    ) -> None: ...

class TraceDeparture:
    trace_key: int
    step: int
    position: int
    expected: int
    actual: int

class CoordinatorStats:
    steps: int
    aborted_steps: int
    module_calls: int
    gathers: int
    elements_gathered: int
    bytes_gathered: int
    prefetch_gathers: int
    prefetch_hits: int
    prefetch_misses: int
    resident_hits: int
    prefetch_unused: int
    releases: int
    trace_departures: int
    trace_resyncs: int
    trace_recordings: int
    live_elements: int
    peak_live_elements: int
    persistent_elements: int
    shard_fetches: int
    shard_bytes_fetched: int
    shard_fetches_ahead: int
    shard_fetches_unused: int
    shard_stores: int
    shard_bytes_stored: int
    staged_bytes: int
    peak_staged_bytes: int

class ParamCoordinator:
    def __init__(self, config: CoordinatorConfig) -> None: ...
    def register_group(
        self, numel: int, element_size: int, *, shard_numel: int | None = None, tier: ShardTier = ShardTier.DEVICE
    ) -> int: ...
    def register_module(self, groups: list[int]) -> int: ...
    def begin_step(self, trace_key: int = 0) -> None: ...
    def before_module(self, module: int) -> Plan: ...
    def after_module(self, module: int) -> Plan: ...
    def end_step(self) -> Plan: ...
    def abort_step(self) -> Plan: ...
    def release_all(self) -> Plan: ...
    def store_shards(self, updated: list[int]) -> Plan: ...
    def finish_stores(self) -> Plan: ...
    def take_departure_notice(self) -> TraceDeparture | None: ...
    def state(self, group: int) -> GroupState: ...
    def use_count(self, group: int) -> int: ...
    def persistent(self, group: int) -> bool: ...
    def shard_tier(self, group: int) -> ShardTier: ...
    def shard_state(self, group: int) -> ShardState: ...
    def module_groups(self, module: int) -> list[int]: ...
    def unforeseen(self, module: int) -> bool: ...
    def trace(self, trace_key: int = 0) -> list[int]: ...
    def stats(self) -> CoordinatorStats: ...
    def reset_peak(self) -> None: ...
    @property
    def in_step(self) -> bool: ...
    @property
    def recording(self) -> bool: ...
    @property
    def config(self) -> CoordinatorConfig: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def num_modules(self) -> int: ...


# swap manager (ownership and leftovers: note "swap file ownership" in cpp/include/zcore/swap_file.h)

class SwapState(enum.Enum):
    WRITING = 0
    ON_DISK = 1
    READING = 2

class SwapConfig:
    directory: str
    rank: int
    name: str
    capacity: int
    io: object  # an AioConfig
    def __init__(self) -> None: ...

class SwapExtent:
    @property
    def offset(self) -> int: ...
    @property
    def bytes(self) -> int: ...

class SwapStats:
    @property
    def capacity(self) -> int: ...
    @property
    def used(self) -> int: ...
    @property
    def largest_free(self) -> int: ...
    @property
    def entries(self) -> int: ...
    @property
    def bytes_swapped_out(self) -> int: ...
    @property
    def bytes_swapped_in(self) -> int: ...
    @property
    def leftover_bytes_removed(self) -> int: ...

class SwapManager:
    def __init__(self, config: SwapConfig) -> None: ...
    def swap_out(self, id: int, data: int, bytes: int) -> None: ...
    def swap_in(self, id: int, data: int, bytes: int) -> None: ...
    def poll(self, id: int) -> bool: ...
    def wait(self, id: int) -> None: ...
    def wait_all(self) -> None: ...
    def release(self, id: int) -> None: ...
    def contains(self, id: int) -> bool: ...
    def state(self, id: int) -> SwapState: ...
    def extent(self, id: int) -> SwapExtent: ...
    def ids(self) -> list[int]: ...
    def stats(self) -> SwapStats: ...
    @property
    def path(self) -> str: ...
    @property
    def leftovers_removed(self) -> list[str]: ...
    @property
    def backend(self) -> object: ...  # an IoBackend
    def close(self) -> None: ...
