// Swap manager: where each swapped-out tensor lives on disk, and the I/O that
// moves it out and back in.
//
// Each manager owns one swap file under a user-given directory, sized for the
// `capacity` bytes it plans to swap. Tensors are identified by a caller-chosen
// id; each id owns an extent of the file (offset and size aligned to
// kIoAlignment, so aligned buffers take the O_DIRECT path with no bounce).
// Extents are placed best-fit and freed extents are reused and coalesced (a
// ContiguousAllocator over the file's byte range, without compaction).
//
// The caller owns the memory (Python holds the tensors): swap_out() and
// swap_in() start asynchronous I/O on a buffer that must stay valid until
// wait(id). Several ids can be in flight at once, which is how the pipeline
// works: start swapping in the next item while the current one is used, and
// swap out the previous one.
//
// The file itself (swap_file.h) is named, created, locked and removed by a
// SwapFile, which also sweeps the leftover files of killed processes from the
// directory (note "swap file ownership": the directory may be shared by
// every rank of every job) and checks, before training starts, that the
// directory exists, accepts a new file and has `capacity` bytes free. The
// file is not preallocated: it grows as extents are first written, so a
// swap-out that needs new blocks (a first write, or any write on a
// copy-on-write filesystem) can still fail with kNoSpace when the disk has
// filled since; the error then names the swap file, `required` and
// `available`. close() (or the destructor) waits for pending I/O, removes the
// swap file and releases its lock.
//
// The swap file is checked to be the one created (device and inode) before
// every I/O is submitted and again when it completes. A file deleted (a tmp
// cleaner) or replaced under the manager is kSwapFileLost, never a swap-in of
// zeros or of another file's bytes: the swapped-out bytes are gone, so every
// later call but close() raises the same error (create a new manager), and
// close() leaves a file that is not its own in place.
//
// Each swap-out records an XXH3 checksum of the caller's bytes; a swap-in is
// checked against it when it completes (in wait(), outside the lock). A file
// changed in place, a bug that overlapped two extents, or a disk that returned
// other bytes is kSwapCorrupted naming the id, path and offset, never a silent
// swap-in of wrong bytes. The cost (one pass over the bytes at ~20 GB/s, against
// a disk at 1-3 GB/s) is measured in bench/swap.py.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "zcore/aio_engine.h"
#include "zcore/allocator.h"
#include "zcore/status.h"
#include "zcore/swap_file.h"

namespace zcore {

using SwapId = std::int64_t;

// Life of one id in the swap manager (ids not present are not swapped).
enum class SwapState {
  kWriting,  // swap-out in flight: the caller's buffer is being read
  kOnDisk,   // bytes are in the swap file, no I/O in flight
  kReading,  // swap-in in flight: the caller's buffer is being filled
};

const char* swap_state_name(SwapState state);

struct SwapConfig {
  std::string directory;     // must exist and be writable; may be shared (note in swap_file.h)
  int rank = 0;              // named in the swap file, for people looking at the directory
  std::string name;          // purpose tag in the file name ("params", "optimizer"):
                             // [A-Za-z0-9_]{0,64}, else kInvalidArgument
  std::int64_t capacity = 0; // bytes of swap space this rank plans to use
  AioConfig io;              // engine settings; probe_directory is set to `directory`
};

struct SwapExtent {
  std::uint64_t offset;  // in the swap file, aligned to kIoAlignment
  std::uint64_t bytes;   // bytes swapped out (the extent is rounded up)
};

struct SwapStats {
  std::uint64_t capacity;
  std::uint64_t used;          // bytes in extents (rounded to kIoAlignment)
  std::uint64_t largest_free;  // largest extent that can still be allocated
  std::uint64_t entries;
  std::uint64_t bytes_swapped_out;
  std::uint64_t bytes_swapped_in;
  std::uint64_t leftover_bytes_removed;  // sizes of the files in leftovers_removed()
};

class SwapManager {
 public:
  explicit SwapManager(const SwapConfig& config);
  ~SwapManager();
  SwapManager(const SwapManager&) = delete;
  SwapManager& operator=(const SwapManager&) = delete;

  // Starts writing `bytes` (> 0) from `data` to the extent of `id`: a new id
  // gets a new extent (kNoSpace when the capacity has no free range large
  // enough); an id on disk is overwritten in place when its extent is large
  // enough, else moved to a new extent. kInvalidArgument while `id` has I/O
  // in flight.
  void swap_out(SwapId id, const void* data, std::int64_t bytes);
  // Starts reading the bytes of `id` into `data`; `bytes` must equal what was
  // swapped out. The id stays on disk (swap it out again to overwrite it).
  void swap_in(SwapId id, void* data, std::int64_t bytes);

  // True when `id` has no I/O in flight (also after it failed).
  bool poll(SwapId id);
  // Waits for the I/O of `id` and throws its error. A failed swap-out drops
  // the id (its extent held partial bytes); a failed swap-in leaves it on disk
  // (kSwapCorrupted: the bytes read are not those swapped out).
  void wait(SwapId id);
  // Waits for every id; throws the first error after all have finished.
  void wait_all();
  // Forgets `id` and frees its extent for reuse (kInvalidArgument while in flight).
  void release(SwapId id);

  bool contains(SwapId id) const;
  SwapState state(SwapId id) const;
  SwapExtent extent(SwapId id) const;
  std::vector<SwapId> ids() const;
  SwapStats stats() const;
  const std::string& path() const { return file_.path(); }
  // Leftover swap files of dead processes that the constructor removed.
  const std::vector<std::string>& leftovers_removed() const { return file_.leftovers_removed(); }
  const AioEngine& engine() const;

  // Waits for pending I/O (discarding its errors), removes the swap file and
  // releases its lock. Any later call but close() throws kInvalidArgument.
  void close();

 private:
  struct Entry {
    SwapState state;
    BlockHandle extent;
    std::int64_t bytes;
    std::uint64_t checksum;  // XXH3-64 of the bytes swapped out
    IoHandle io;             // valid while kWriting or kReading
    void* destination;       // the caller's buffer while kReading
  };

  Entry& find(SwapId id);
  const Entry& find(SwapId id) const;
  void check_open() const;
  void check_usable() const;  // open, and the swap file not lost
  BlockHandle allocate_extent(SwapId id, std::uint64_t bytes);
  void wait_unlocked(SwapId id, std::unique_lock<std::mutex>& lock);
  // Throws kSwapCorrupted unless the bytes swapped in match entry.checksum;
  // reads only `entry` (a copy) and path(), so it runs without the lock.
  void verify(SwapId id, const Entry& entry, std::int64_t offset) const;
  // Throws kSwapFileLost (and remembers it) unless path() is still the file created.
  void check_file();

  const SwapConfig config_;
  SwapFile file_;  // before extents_ and engine_: it checks the config first
  std::unique_ptr<Error> lost_;  // set once the file was found deleted or replaced
  ContiguousAllocator extents_;
  std::unique_ptr<AioEngine> engine_;

  mutable std::mutex mutex_;
  std::unordered_map<SwapId, Entry> entries_;
  bool closed_ = false;
  std::uint64_t bytes_out_ = 0;
  std::uint64_t bytes_in_ = 0;
};

}  // namespace zcore
