#include "zcore/allocator.h"

#include <atomic>
#include <cstring>
#include <string>

#include "zcore/status.h"

namespace zcore {
namespace {

constexpr int kSerialBits = 40;
constexpr std::uint64_t kSerialMask = (std::uint64_t{1} << kSerialBits) - 1;
constexpr std::uint64_t kIdMask = (std::uint64_t{1} << (64 - kSerialBits)) - 1;

std::uint64_t next_allocator_id() {
  static std::atomic<std::uint64_t> counter{0};
  // Ids start at 1 and wrap within 24 bits, skipping 0 so no valid handle
  // is ever 0 (0 marks free blocks).
  std::uint64_t id;
  do {
    id = (counter.fetch_add(1) + 1) & kIdMask;
  } while (id == 0);
  return id;
}

bool is_power_of_two(std::int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

std::uint64_t align_up(std::uint64_t v, std::uint64_t alignment) {
  return (v + alignment - 1) & ~(alignment - 1);
}

}  // namespace

void HostByteMover::apply(const std::vector<Move>& moves) {
  for (const Move& m : moves) std::memmove(base_ + m.dst, base_ + m.src, m.bytes);
}

ContiguousAllocator::ContiguousAllocator(std::int64_t capacity,
                                         std::unique_ptr<ByteMover> mover)
    : capacity_(capacity > 0 ? static_cast<std::uint64_t>(capacity) : 0),
      id_(next_allocator_id()),
      mover_(std::move(mover)) {
  if (capacity <= 0) {
    throw Error(StatusCode::kInvalidArgument,
                "arena capacity must be a positive number of bytes, got " +
                    std::to_string(capacity),
                {{"capacity", capacity}});
  }
  insert_free(0, capacity_);
}

BlockHandle ContiguousAllocator::allocate(std::int64_t bytes, std::int64_t alignment) {
  if (bytes <= 0) {
    throw Error(StatusCode::kInvalidArgument,
                "allocation size must be a positive number of bytes, got " +
                    std::to_string(bytes),
                {{"bytes", bytes}});
  }
  if (!is_power_of_two(alignment)) {
    throw Error(StatusCode::kInvalidArgument,
                "alignment must be a power of two (1, 2, 4, ... bytes), got " +
                    std::to_string(alignment),
                {{"alignment", alignment}});
  }
  const auto want = static_cast<std::uint64_t>(bytes);
  const auto align = static_cast<std::uint64_t>(alignment);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = best_fit(want, align);
  if (it == blocks_.end() && mover_ && capacity_ - used_ >= want) {
    mover_->apply(compact());
    it = best_fit(want, align);
  }
  if (it == blocks_.end()) throw_out_of_arena(want, align);
  return carve(it, want, align);
}

void ContiguousAllocator::free(BlockHandle handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = find_live(handle);
  const std::uint64_t offset = it->first;
  std::uint64_t bytes = it->second.bytes;
  live_offsets_.erase(handle);
  used_ -= bytes;

  // Coalesce with the neighbours; by the tiling invariant each neighbour is
  // either live or a single free block.
  std::uint64_t start = offset;
  auto next = std::next(it);
  if (next != blocks_.end() && next->second.handle == 0) {
    bytes += next->second.bytes;
    erase_free(next);
  }
  if (it != blocks_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.handle == 0) {
      start = prev->first;
      bytes += prev->second.bytes;
      erase_free(prev);
    }
  }
  blocks_.erase(offset);
  insert_free(start, bytes);
}

std::uint64_t ContiguousAllocator::offset(BlockHandle handle) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return find_live(handle)->first;
}

std::uint64_t ContiguousAllocator::size(BlockHandle handle) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return find_live(handle)->second.bytes;
}

std::vector<Move> ContiguousAllocator::defragment() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Move> moves = compact();
  if (mover_) mover_->apply(moves);
  return moves;
}

AllocatorStats ContiguousAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  AllocatorStats s{};
  s.capacity = capacity_;
  s.used = used_;
  s.free = capacity_ - used_;
  s.largest_free = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
  s.live_blocks = live_offsets_.size();
  s.free_blocks = free_by_size_.size();
  s.fragmentation =
      s.free == 0 ? 0.0 : 1.0 - static_cast<double>(s.largest_free) / static_cast<double>(s.free);
  s.peak_used = peak_used_;
  s.allocations = allocations_;
  s.defragmentations = generation_;
  s.bytes_moved = bytes_moved_;
  return s;
}

std::vector<BlockInfo> ContiguousAllocator::blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<BlockInfo> out;
  out.reserve(blocks_.size());
  for (const auto& [offset, block] : blocks_) out.push_back({offset, block.bytes, block.handle});
  return out;
}

std::uint64_t ContiguousAllocator::generation() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return generation_;
}

ContiguousAllocator::BlockMap::const_iterator ContiguousAllocator::find_live(
    BlockHandle handle) const {
  if ((handle >> kSerialBits) != id_) {
    throw Error(StatusCode::kInvalidHandle,
                "block handle " + std::to_string(handle) +
                    " belongs to another arena (or is not a handle); free and look up "
                    "blocks only in the arena that allocated them",
                {{"handle", static_cast<std::int64_t>(handle)}});
  }
  auto live = live_offsets_.find(handle);
  if (live == live_offsets_.end()) {
    throw Error(StatusCode::kInvalidHandle,
                "block handle " + std::to_string(handle & kSerialMask) +
                    " of this arena is not live: it was already freed",
                {{"handle", static_cast<std::int64_t>(handle)}});
  }
  return blocks_.find(live->second);
}

ContiguousAllocator::BlockMap::iterator ContiguousAllocator::find_live(BlockHandle handle) {
  auto it = static_cast<const ContiguousAllocator*>(this)->find_live(handle);
  return blocks_.erase(it, it);  // const_iterator -> iterator without a lookup
}

ContiguousAllocator::BlockMap::iterator ContiguousAllocator::best_fit(std::uint64_t bytes,
                                                                      std::uint64_t alignment) {
  // Smallest free range that holds the request after aligning its start;
  // ties go to the lowest offset (the set orders by (size, offset)).
  for (auto it = free_by_size_.lower_bound({bytes, 0}); it != free_by_size_.end(); ++it) {
    const auto [size, offset] = *it;
    if (align_up(offset, alignment) - offset + bytes <= size) return blocks_.find(offset);
  }
  return blocks_.end();
}

BlockHandle ContiguousAllocator::carve(BlockMap::iterator free_block, std::uint64_t bytes,
                                       std::uint64_t alignment) {
  const std::uint64_t offset = free_block->first;
  const std::uint64_t size = free_block->second.bytes;
  const std::uint64_t start = align_up(offset, alignment);
  erase_free(free_block);
  // The leading gap stays a free block of its own: its left neighbour is live
  // (no two free blocks are adjacent), so there is nothing to merge it with.
  if (start > offset) insert_free(offset, start - offset);
  if (start + bytes < offset + size) insert_free(start + bytes, offset + size - start - bytes);

  const BlockHandle handle = (id_ << kSerialBits) | (next_serial_++ & kSerialMask);
  blocks_.emplace(start, Block{bytes, alignment, handle});
  live_offsets_.emplace(handle, start);
  used_ += bytes;
  if (used_ > peak_used_) peak_used_ = used_;
  ++allocations_;
  return handle;
}

void ContiguousAllocator::insert_free(std::uint64_t offset, std::uint64_t bytes) {
  blocks_.emplace(offset, Block{bytes, 0, 0});
  free_by_size_.emplace(bytes, offset);
}

void ContiguousAllocator::erase_free(BlockMap::iterator it) {
  free_by_size_.erase({it->second.bytes, it->first});
  blocks_.erase(it);
}

std::vector<Move> ContiguousAllocator::compact() {
  std::vector<Move> moves;
  BlockMap packed;
  std::uint64_t cursor = 0;
  for (const auto& [offset, block] : blocks_) {
    if (block.handle == 0) continue;
    // offset is aligned and >= cursor, so dst <= offset: every move goes
    // down, and applying them in offset order never overwrites a source
    // that is still to be moved.
    const std::uint64_t dst = align_up(cursor, block.alignment);
    if (dst != offset) {
      moves.push_back({offset, dst, block.bytes});
      bytes_moved_ += block.bytes;
    }
    if (dst > cursor) packed.emplace(cursor, Block{dst - cursor, 0, 0});
    packed.emplace(dst, block);
    live_offsets_[block.handle] = dst;
    cursor = dst + block.bytes;
  }
  if (cursor < capacity_) packed.emplace(cursor, Block{capacity_ - cursor, 0, 0});
  if (moves.empty()) {
    return moves;  // already compact: the layout above is identical
  }
  blocks_ = std::move(packed);
  free_by_size_.clear();
  for (const auto& [offset, block] : blocks_) {
    if (block.handle == 0) free_by_size_.emplace(block.bytes, offset);
  }
  ++generation_;
  return moves;
}

void ContiguousAllocator::throw_out_of_arena(std::uint64_t bytes, std::uint64_t alignment) const {
  const std::uint64_t free_bytes = capacity_ - used_;
  const std::uint64_t largest = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
  std::string hint = free_bytes >= bytes && !mover_
                         ? "; enough bytes are free but fragmented: call defragment()"
                         : "; free blocks first or create a larger arena";
  throw Error(StatusCode::kOutOfArena,
              "arena out of memory: requested " + std::to_string(bytes) + " bytes (alignment " +
                  std::to_string(alignment) + ") with " + std::to_string(free_bytes) +
                  " bytes free, largest free block " + std::to_string(largest) + " bytes, capacity " +
                  std::to_string(capacity_) + hint,
              {{"requested", static_cast<std::int64_t>(bytes)},
               {"free", static_cast<std::int64_t>(free_bytes)},
               {"largest_free", static_cast<std::int64_t>(largest)},
               {"capacity", static_cast<std::int64_t>(capacity_)}});
}

}  // namespace zcore
