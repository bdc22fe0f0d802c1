// Contiguous allocator: offset bookkeeping inside one arena of fixed capacity
// whose memory someone else owns (host or device).
//
// The allocator hands out byte ranges [offset, offset + bytes) by handle,
// places them best-fit, coalesces adjacent free ranges, and compacts live
// blocks on request (defragment). It never touches the arena's bytes itself:
// moving them is delegated to a ByteMover that knows the memory (memmove for
// host memory; a stream-ordered copy for device memory, in cuda/).
//
// Invariant (the "tiling" note referenced by the tests): the blocks, live and
// free, tile [0, capacity) exactly, in offset order, and no two free blocks
// are adjacent.
//
// All methods are thread-safe. Moving bytes is only safe while nobody reads
// or writes the blocks being moved: defragment() (explicit or automatic)
// changes offsets, and generation() increments each time that happens.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace zcore {

// Opaque: the owning allocator's id in the high 24 bits and a never-reused
// serial in the low 40, so a stale handle or another arena's handle is
// recognised instead of silently freeing someone else's block.
using BlockHandle = std::uint64_t;

struct Move {
  std::uint64_t src;    // offset the block's bytes are at now
  std::uint64_t dst;    // offset they must be at afterwards (dst < src)
  std::uint64_t bytes;  // src and dst ranges may overlap
};

struct BlockInfo {
  std::uint64_t offset;
  std::uint64_t bytes;
  BlockHandle handle;  // 0 for a free block
};

struct AllocatorStats {
  std::uint64_t capacity;
  std::uint64_t used;          // bytes in live blocks
  std::uint64_t free;          // capacity - used, including alignment gaps
  std::uint64_t largest_free;  // largest single free range
  std::uint64_t live_blocks;
  std::uint64_t free_blocks;
  double fragmentation;        // 1 - largest_free / free (0 when free == 0)
  std::uint64_t peak_used;
  std::uint64_t allocations;   // successful allocate() calls
  std::uint64_t defragmentations;  // compactions that moved at least one block
  std::uint64_t bytes_moved;
};

// Moves bytes inside the arena's memory. Moves are applied in the order
// given; each has dst < src and may overlap its own source.
class ByteMover {
 public:
  virtual ~ByteMover() = default;
  virtual void apply(const std::vector<Move>& moves) = 0;
};

// memmove inside a host arena starting at `base`.
class HostByteMover : public ByteMover {
 public:
  explicit HostByteMover(void* base) : base_(static_cast<unsigned char*>(base)) {}
  void apply(const std::vector<Move>& moves) override;

 private:
  unsigned char* base_;
};

class ContiguousAllocator {
 public:
  // Without a mover the allocator is pure bookkeeping: defragment() returns a
  // plan the caller applies. With a mover, defragment() moves the bytes too,
  // and allocate() compacts automatically when enough bytes are free but no
  // single free range fits the request.
  explicit ContiguousAllocator(std::int64_t capacity,
                               std::unique_ptr<ByteMover> mover = nullptr);

  ContiguousAllocator(const ContiguousAllocator&) = delete;
  ContiguousAllocator& operator=(const ContiguousAllocator&) = delete;

  // bytes > 0; alignment a power of two. Throws Error(kOutOfArena) naming
  // the request, the free bytes and the largest free range.
  BlockHandle allocate(std::int64_t bytes, std::int64_t alignment);
  void free(BlockHandle handle);

  std::uint64_t offset(BlockHandle handle) const;
  std::uint64_t size(BlockHandle handle) const;

  // Compacts live blocks towards offset 0, in offset order, honouring each
  // block's alignment. Returns the moves (empty when already compact).
  std::vector<Move> defragment();

  AllocatorStats stats() const;
  std::vector<BlockInfo> blocks() const;  // all blocks, in offset order
  std::uint64_t generation() const;       // number of compactions that moved
  std::uint64_t capacity() const { return capacity_; }
  bool moves_bytes() const { return mover_ != nullptr; }

 private:
  struct Block {
    std::uint64_t bytes;
    std::uint64_t alignment;  // 0 for a free block
    BlockHandle handle;       // 0 for a free block
  };
  using BlockMap = std::map<std::uint64_t, Block>;  // keyed by offset

  BlockMap::iterator find_live(BlockHandle handle);
  BlockMap::const_iterator find_live(BlockHandle handle) const;
  BlockMap::iterator best_fit(std::uint64_t bytes, std::uint64_t alignment);
  BlockHandle carve(BlockMap::iterator free_block, std::uint64_t bytes,
                    std::uint64_t alignment);
  void insert_free(std::uint64_t offset, std::uint64_t bytes);
  void erase_free(BlockMap::iterator it);
  std::vector<Move> compact();
  [[noreturn]] void throw_out_of_arena(std::uint64_t bytes, std::uint64_t alignment) const;

  const std::uint64_t capacity_;
  const std::uint64_t id_;
  const std::unique_ptr<ByteMover> mover_;

  mutable std::mutex mutex_;
  BlockMap blocks_;
  std::set<std::pair<std::uint64_t, std::uint64_t>> free_by_size_;  // (bytes, offset)
  std::unordered_map<BlockHandle, std::uint64_t> live_offsets_;
  std::uint64_t next_serial_ = 1;
  std::uint64_t used_ = 0;
  std::uint64_t peak_used_ = 0;
  std::uint64_t allocations_ = 0;
  std::uint64_t generation_ = 0;
  std::uint64_t bytes_moved_ = 0;
};

}  // namespace zcore
