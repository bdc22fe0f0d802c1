#include "zcore/allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "expect_error.h"
#include "zcore/status.h"

namespace zcore {
namespace {

using testing_support::code_of;

// Checks the tiling invariant (see allocator.h) and the statistics against
// the block list, and returns the live blocks by handle.
std::map<BlockHandle, BlockInfo> check_layout(const ContiguousAllocator& a) {
  std::map<BlockHandle, BlockInfo> live;
  const auto blocks = a.blocks();
  std::uint64_t cursor = 0, used = 0, largest = 0, free_blocks = 0;
  bool prev_free = false;
  for (const BlockInfo& b : blocks) {
    EXPECT_EQ(b.offset, cursor) << "blocks must tile the arena without gaps or overlap";
    EXPECT_GT(b.bytes, 0u);
    const bool is_free = b.handle == 0;
    EXPECT_FALSE(is_free && prev_free) << "adjacent free blocks at " << b.offset;
    if (is_free) {
      largest = std::max(largest, b.bytes);
      ++free_blocks;
    } else {
      used += b.bytes;
      live[b.handle] = b;
    }
    prev_free = is_free;
    cursor += b.bytes;
  }
  EXPECT_EQ(cursor, a.capacity());
  const AllocatorStats s = a.stats();
  EXPECT_EQ(s.used, used);
  EXPECT_EQ(s.free, a.capacity() - used);
  EXPECT_EQ(s.largest_free, largest);
  EXPECT_EQ(s.free_blocks, free_blocks);
  EXPECT_EQ(s.live_blocks, live.size());
  return live;
}

TEST(ContiguousAllocator, AllocatesBestFit) {
  ContiguousAllocator a(1000);
  const BlockHandle h1 = a.allocate(100, 1);
  const BlockHandle h2 = a.allocate(300, 1);
  const BlockHandle h3 = a.allocate(50, 1);
  const BlockHandle h4 = a.allocate(200, 1);
  EXPECT_EQ(a.offset(h1), 0u);
  EXPECT_EQ(a.offset(h2), 100u);
  EXPECT_EQ(a.offset(h3), 400u);
  EXPECT_EQ(a.offset(h4), 450u);
  a.free(h1);  // hole of 100 at 0
  a.free(h3);  // hole of 50 at 400; tail hole of 350 at 650
  // 40 bytes go to the smallest hole that fits (50 at 400), not the first.
  EXPECT_EQ(a.offset(a.allocate(40, 1)), 400u);
  EXPECT_EQ(a.offset(a.allocate(90, 1)), 0u);
  EXPECT_EQ(a.offset(a.allocate(300, 1)), 650u);
  check_layout(a);
}

TEST(ContiguousAllocator, CoalescesBothNeighbours) {
  ContiguousAllocator a(300);
  const BlockHandle h1 = a.allocate(100, 1);
  const BlockHandle h2 = a.allocate(100, 1);
  const BlockHandle h3 = a.allocate(100, 1);
  a.free(h1);
  a.free(h3);
  EXPECT_EQ(a.stats().free_blocks, 2u);
  a.free(h2);
  const AllocatorStats s = a.stats();
  EXPECT_EQ(s.free_blocks, 1u);
  EXPECT_EQ(s.largest_free, 300u);
  EXPECT_EQ(s.fragmentation, 0.0);
  check_layout(a);
}

TEST(ContiguousAllocator, HonoursAlignmentAndKeepsTheGapFree) {
  ContiguousAllocator a(4096);
  a.allocate(3, 1);
  const BlockHandle h = a.allocate(10, 256);
  EXPECT_EQ(a.offset(h), 256u);
  const auto blocks = a.blocks();
  ASSERT_EQ(blocks.size(), 4u);
  EXPECT_EQ(blocks[1].offset, 3u);  // the 253-byte gap is a free block
  EXPECT_EQ(blocks[1].handle, 0u);
  // A small request fills the gap instead of the tail.
  EXPECT_EQ(a.offset(a.allocate(200, 4)), 4u);
  check_layout(a);
}

TEST(ContiguousAllocator, ReportsFragmentation) {
  ContiguousAllocator a(400);
  std::vector<BlockHandle> h;
  for (int i = 0; i < 4; ++i) h.push_back(a.allocate(100, 1));
  a.free(h[0]);
  a.free(h[2]);
  const AllocatorStats s = a.stats();
  EXPECT_EQ(s.free, 200u);
  EXPECT_EQ(s.largest_free, 100u);
  EXPECT_DOUBLE_EQ(s.fragmentation, 0.5);
}

TEST(ContiguousAllocator, ExhaustionIsAStatusNamingTheFigures) {
  ContiguousAllocator a(1024);
  a.allocate(1000, 1);
  try {
    a.allocate(100, 1);
    FAIL() << "expected OutOfArena";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kOutOfArena);
    std::map<std::string, std::int64_t> d;
    for (const auto& [k, v] : e.details()) d[k] = std::get<std::int64_t>(v);
    EXPECT_EQ(d["requested"], 100);
    EXPECT_EQ(d["free"], 24);
    EXPECT_EQ(d["largest_free"], 24);
    EXPECT_NE(std::string(e.what()).find("requested 100 bytes"), std::string::npos);
  }
  check_layout(a);
}

TEST(ContiguousAllocator, RejectsBadInputAndStaysConsistent) {
  ContiguousAllocator a(1024);
  const BlockHandle h = a.allocate(64, 8);
  EXPECT_EQ(code_of([&] { a.allocate(0, 8); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { a.allocate(-5, 8); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { a.allocate(8, 3); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { a.allocate(8, 0); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { a.allocate(8, -4); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([] { ContiguousAllocator bad(0); }), StatusCode::kInvalidArgument);

  ContiguousAllocator other(1024);
  const BlockHandle foreign = other.allocate(64, 8);
  EXPECT_EQ(code_of([&] { a.free(foreign); }), StatusCode::kInvalidHandle);
  EXPECT_EQ(code_of([&] { a.offset(foreign); }), StatusCode::kInvalidHandle);
  EXPECT_EQ(code_of([&] { a.free(0); }), StatusCode::kInvalidHandle);
  a.free(h);
  EXPECT_EQ(code_of([&] { a.free(h); }), StatusCode::kInvalidHandle);
  EXPECT_EQ(code_of([&] { a.size(h); }), StatusCode::kInvalidHandle);

  const auto live = check_layout(a);
  EXPECT_TRUE(live.empty());
  EXPECT_EQ(a.stats().largest_free, 1024u);
  EXPECT_EQ(other.offset(foreign), 0u);  // the other arena is untouched
}

TEST(ContiguousAllocator, DefragmentPlanCompactsInOrder) {
  ContiguousAllocator a(1000);
  std::vector<BlockHandle> h;
  for (int i = 0; i < 5; ++i) h.push_back(a.allocate(100, 1));
  a.free(h[0]);
  a.free(h[2]);
  const std::vector<Move> moves = a.defragment();
  ASSERT_EQ(moves.size(), 3u);
  EXPECT_EQ(moves[0].src, 100u);
  EXPECT_EQ(moves[0].dst, 0u);
  EXPECT_EQ(moves[1].src, 300u);
  EXPECT_EQ(moves[1].dst, 100u);
  EXPECT_EQ(moves[2].src, 400u);
  EXPECT_EQ(moves[2].dst, 200u);
  EXPECT_EQ(a.offset(h[1]), 0u);
  EXPECT_EQ(a.offset(h[4]), 200u);
  EXPECT_EQ(a.stats().largest_free, 700u);
  EXPECT_EQ(a.generation(), 1u);
  EXPECT_TRUE(a.defragment().empty());  // already compact: no moves, same generation
  EXPECT_EQ(a.generation(), 1u);
  check_layout(a);
}

TEST(ContiguousAllocator, WithoutAMoverAllocationDoesNotCompact) {
  ContiguousAllocator a(300);
  const BlockHandle h1 = a.allocate(100, 1);
  a.allocate(100, 1);
  const BlockHandle h3 = a.allocate(100, 1);
  a.free(h1);
  a.free(h3);
  EXPECT_EQ(code_of([&] { a.allocate(150, 1); }), StatusCode::kOutOfArena);
  EXPECT_EQ(a.generation(), 0u);
}

// An arena over real host memory: each block holds a pattern derived from
// its handle, which must survive every compaction.
class HostArena {
 public:
  explicit HostArena(std::uint64_t capacity)
      : memory_(capacity),
        alloc_(static_cast<std::int64_t>(capacity),
               std::make_unique<HostByteMover>(memory_.data())) {}

  ContiguousAllocator& alloc() { return alloc_; }

  void fill(BlockHandle h) {
    unsigned char* p = memory_.data() + alloc_.offset(h);
    const std::uint64_t n = alloc_.size(h);
    for (std::uint64_t i = 0; i < n; ++i) p[i] = pattern(h, i);
  }

  bool intact(BlockHandle h) {
    const unsigned char* p = memory_.data() + alloc_.offset(h);
    const std::uint64_t n = alloc_.size(h);
    for (std::uint64_t i = 0; i < n; ++i) {
      if (p[i] != pattern(h, i)) return false;
    }
    return true;
  }

 private:
  static unsigned char pattern(BlockHandle h, std::uint64_t i) {
    return static_cast<unsigned char>((h * 2654435761u + i * 40503u) >> 7);
  }

  std::vector<unsigned char> memory_;
  ContiguousAllocator alloc_;
};

TEST(ContiguousAllocator, WithAMoverAllocationCompactsAndKeepsData) {
  HostArena arena(300);
  ContiguousAllocator& a = arena.alloc();
  const BlockHandle h1 = a.allocate(100, 1);
  const BlockHandle h2 = a.allocate(100, 1);
  const BlockHandle h3 = a.allocate(100, 1);
  arena.fill(h2);
  a.free(h1);
  a.free(h3);
  const BlockHandle big = a.allocate(150, 1);  // fits only after compaction
  EXPECT_EQ(a.generation(), 1u);
  EXPECT_EQ(a.offset(h2), 0u);
  EXPECT_EQ(a.offset(big), 100u);
  EXPECT_TRUE(arena.intact(h2));
  // More than the free bytes: still a status, and nothing moves.
  EXPECT_EQ(code_of([&] { a.allocate(51, 1); }), StatusCode::kOutOfArena);
  EXPECT_EQ(a.generation(), 1u);
  check_layout(a);
}

TEST(ContiguousAllocator, OverlappingMoveKeepsData) {
  HostArena arena(1 << 16);
  ContiguousAllocator& a = arena.alloc();
  const BlockHandle pad = a.allocate(16, 1);
  const BlockHandle big = a.allocate(40000, 1);  // moves down by 16: overlaps itself
  arena.fill(big);
  a.free(pad);
  const auto moves = a.defragment();
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_LT(moves[0].src - moves[0].dst, moves[0].bytes);
  EXPECT_TRUE(arena.intact(big));
}

struct Expected {
  std::uint64_t bytes;
  std::uint64_t alignment;
};

std::uint64_t align_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// A refusal is right only if no free range holds the request and, when
// enough bytes are free in total, the arena was already compacted (every
// live block sits at the first aligned offset after its predecessor).
bool refusal_is_justified(const ContiguousAllocator& a, const std::map<BlockHandle, Expected>& model,
                          std::uint64_t bytes, std::uint64_t alignment) {
  std::uint64_t cursor = 0;
  bool compact = true;
  for (const BlockInfo& b : a.blocks()) {
    if (b.handle == 0) {
      if (align_up(b.offset, alignment) + bytes <= b.offset + b.bytes) return false;
      continue;
    }
    compact = compact && b.offset == align_up(cursor, model.at(b.handle).alignment);
    cursor = b.offset + b.bytes;
  }
  return a.stats().free < bytes || compact;
}

// Long random alloc/free/defragment sequences against a reference model (the
// set of live handles with their sizes and alignments): after every
// operation the layout tiles the arena, live blocks match the model and are
// aligned, and every block's bytes are intact.
TEST(ContiguousAllocator, RandomSequencesMatchTheReferenceModel) {
  for (std::uint32_t seed = 1; seed <= 60; ++seed) {
    std::mt19937_64 rng(seed);
    const std::uint64_t capacity = 1 + rng() % (1 << 16);
    HostArena arena(capacity);
    ContiguousAllocator& a = arena.alloc();
    std::map<BlockHandle, Expected> model;
    std::uint64_t model_used = 0;
    for (int op = 0; op < 3000; ++op) {
      const unsigned kind = rng() % 10;
      if (kind < 6) {
        const std::uint64_t bytes = 1 + rng() % std::max<std::uint64_t>(1, capacity / 8);
        const std::uint64_t alignment = std::uint64_t{1} << (rng() % 9);
        try {
          const BlockHandle h = a.allocate(static_cast<std::int64_t>(bytes),
                                           static_cast<std::int64_t>(alignment));
          ASSERT_EQ(model.count(h), 0u) << "handle reused";
          model[h] = {bytes, alignment};
          model_used += bytes;
          arena.fill(h);
        } catch (const Error& e) {
          ASSERT_EQ(e.code(), StatusCode::kOutOfArena);
          ASSERT_TRUE(refusal_is_justified(a, model, bytes, alignment)) << "seed " << seed;
        }
      } else if (kind < 9 && !model.empty()) {
        auto it = model.begin();
        std::advance(it, static_cast<long>(rng() % model.size()));
        ASSERT_TRUE(arena.intact(it->first));
        a.free(it->first);
        model_used -= it->second.bytes;
        model.erase(it);
      } else {
        a.defragment();
      }
      const auto live = check_layout(a);
      ASSERT_EQ(live.size(), model.size());
      for (const auto& [h, exp] : model) {
        const auto found = live.find(h);
        ASSERT_NE(found, live.end());
        ASSERT_EQ(found->second.bytes, exp.bytes);
        ASSERT_EQ(found->second.offset % exp.alignment, 0u);
      }
    }
    for (const auto& [h, exp] : model) ASSERT_TRUE(arena.intact(h)) << "seed " << seed;
  }
}

TEST(ContiguousAllocator, ConcurrentUseStaysConsistent) {
  ContiguousAllocator a(1 << 20);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&a, t] {
      std::mt19937 rng(t);
      std::vector<BlockHandle> mine;
      for (int i = 0; i < 5000; ++i) {
        if (mine.empty() || rng() % 3 != 0) {
          try {
            mine.push_back(a.allocate(1 + rng() % 2048, 64));
          } catch (const Error&) {
          }
        } else {
          a.free(mine.back());
          mine.pop_back();
        }
        if (i % 1000 == 0) a.defragment();
      }
      for (BlockHandle h : mine) a.free(h);
    });
  }
  for (auto& th : threads) th.join();
  check_layout(a);
  EXPECT_EQ(a.stats().used, 0u);
  EXPECT_EQ(a.stats().free_blocks, 1u);
}

}  // namespace
}  // namespace zcore
