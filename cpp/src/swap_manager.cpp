#include "zcore/swap_manager.h"

#include <utility>

#include "hex.h"
#include "zcore/status.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace zcore {
namespace {

std::uint64_t checksum(const void* data, std::int64_t bytes) {
  return XXH3_64bits(data, static_cast<std::size_t>(bytes));
}

std::int64_t round_up(std::int64_t v) { return (v + kIoAlignment - 1) / kIoAlignment * kIoAlignment; }

SwapFileConfig file_config(const SwapConfig& c) {
  SwapFileConfig f;
  f.directory = c.directory;
  f.rank = c.rank;
  f.name = c.name;
  f.capacity = c.capacity;
  return f;
}

AioConfig engine_config(const SwapConfig& c) {
  AioConfig io = c.io;
  io.probe_directory = c.directory;
  return io;
}

}  // namespace

const char* swap_state_name(SwapState state) {
  switch (state) {
    case SwapState::kWriting: return "writing";
    case SwapState::kOnDisk: return "on_disk";
    case SwapState::kReading: return "reading";
  }
  return "unknown";
}

SwapManager::SwapManager(const SwapConfig& config)
    : config_(config),
      file_(file_config(config)),
      extents_(round_up(config.capacity)),
      engine_(AioEngine::create(engine_config(config))) {}

SwapManager::~SwapManager() { close(); }

const AioEngine& SwapManager::engine() const {
  check_open();
  return *engine_;
}

void SwapManager::check_open() const {
  if (closed_) {
    throw Error(StatusCode::kInvalidArgument,
                "the swap manager of " + path() + " was closed; create a new one",
                {{"path", path()}});
  }
}

void SwapManager::check_usable() const {
  check_open();
  if (lost_) throw *lost_;
}

void SwapManager::check_file() {
  std::int64_t found = 0;
  if (file_.intact(&found)) return;
  const bool present = found != 0;
  lost_ = std::make_unique<Error>(
      StatusCode::kSwapFileLost,
      "the swap file " + path() + " was " +
          (present ? "replaced by another file (inode " + std::to_string(file_.inode()) +
                         " is now " + std::to_string(found) + ")"
                   : std::string("deleted")) +
          " while " + std::to_string(entries_.size()) +
          " tensors were swapped out to it; their bytes are gone. Keep swap directories away from "
          "tmp cleaners and other jobs, and create a new swap manager",
      std::vector<std::pair<std::string, ErrorDetail>>{
          {"path", path()},
          {"inode", static_cast<std::int64_t>(file_.inode())},
          {"found_inode", found}});
  throw *lost_;
}

SwapManager::Entry& SwapManager::find(SwapId id) {
  return const_cast<Entry&>(static_cast<const SwapManager*>(this)->find(id));
}

const SwapManager::Entry& SwapManager::find(SwapId id) const {
  check_open();
  const auto it = entries_.find(id);
  if (it == entries_.end()) {
    throw Error(StatusCode::kInvalidArgument,
                "swap id " + std::to_string(id) + " is not swapped out; swap it out first",
                {{"id", id}});
  }
  return it->second;
}

void SwapManager::swap_out(SwapId id, const void* data, std::int64_t bytes) {
  if (bytes <= 0 || data == nullptr) {
    throw Error(StatusCode::kInvalidArgument,
                "swap_out needs a buffer and bytes > 0, got bytes=" + std::to_string(bytes),
                {{"id", id}, {"bytes", bytes}});
  }
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable();
  const auto it = entries_.find(id);
  const bool existed = it != entries_.end();
  if (existed && it->second.state != SwapState::kOnDisk) {
    throw Error(StatusCode::kInvalidArgument,
                "swap id " + std::to_string(id) + " has I/O in flight (" +
                    swap_state_name(it->second.state) + "); wait(id) before swapping it out again",
                {{"id", id}});
  }
  const auto extent_bytes = static_cast<std::uint64_t>(round_up(bytes));
  BlockHandle extent = existed ? it->second.extent : 0;
  BlockHandle outgrown = 0;  // freed once the new extent is written to
  if (existed && extents_.size(extent) < extent_bytes) {
    outgrown = extent;
    extent = 0;
  }
  const bool fresh = extent == 0;
  if (fresh) extent = allocate_extent(id, extent_bytes);
  const auto offset = static_cast<std::int64_t>(extents_.offset(extent));
  IoHandle io;
  try {
    check_file();
    io = engine_->submit({IoOp::kWrite, const_cast<void*>(data), bytes, path(), offset});
  } catch (...) {
    if (fresh) extents_.free(extent);
    throw;
  }
  if (outgrown != 0) extents_.free(outgrown);
  // After the submit, so the pass over the bytes overlaps their write (the
  // caller's buffer is stable until wait(id); the disk only reads it).
  entries_[id] = Entry{SwapState::kWriting, extent, bytes, checksum(data, bytes), io, nullptr};
}

BlockHandle SwapManager::allocate_extent(SwapId id, std::uint64_t bytes) {
  try {
    return extents_.allocate(static_cast<std::int64_t>(bytes), kIoAlignment);
  } catch (const Error& e) {
    if (e.code() != StatusCode::kOutOfArena) throw;
    const AllocatorStats s = extents_.stats();
    throw Error(StatusCode::kNoSpace,
                "swap space of rank " + std::to_string(config_.rank) + " is full: id " +
                    std::to_string(id) + " needs " + std::to_string(bytes) +
                    " bytes, the largest free extent of the " + std::to_string(s.capacity) +
                    "-byte swap file is " + std::to_string(s.largest_free) +
                    " bytes; raise the swap capacity or release ids",
                {{"id", id},
                 {"requested", static_cast<std::int64_t>(bytes)},
                 {"available", static_cast<std::int64_t>(s.largest_free)},
                 {"capacity", static_cast<std::int64_t>(s.capacity)},
                 {"path", path()}});
  }
}

void SwapManager::swap_in(SwapId id, void* data, std::int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable();
  Entry& e = find(id);
  if (e.state != SwapState::kOnDisk) {
    throw Error(StatusCode::kInvalidArgument,
                "swap id " + std::to_string(id) + " has I/O in flight (" +
                    swap_state_name(e.state) + "); wait(id) before swapping it in",
                {{"id", id}});
  }
  if (data == nullptr || bytes != e.bytes) {
    throw Error(StatusCode::kInvalidArgument,
                "swap_in of id " + std::to_string(id) + " needs a buffer of the " +
                    std::to_string(e.bytes) + " bytes swapped out, got " + std::to_string(bytes),
                {{"id", id}, {"bytes", bytes}, {"expected", e.bytes}});
  }
  const auto offset = static_cast<std::int64_t>(extents_.offset(e.extent));
  check_file();
  e.io = engine_->submit({IoOp::kRead, data, bytes, path(), offset});
  e.destination = data;
  e.state = SwapState::kReading;
}

bool SwapManager::poll(SwapId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Entry& e = find(id);
  return e.state == SwapState::kOnDisk || engine_->poll(e.io);
}

void SwapManager::wait_unlocked(SwapId id, std::unique_lock<std::mutex>& lock) {
  const Entry& before = find(id);
  if (before.state == SwapState::kOnDisk) return;
  // Copies: other calls may change the map and the extents while unlocked.
  const Entry entry = before;
  const auto offset = static_cast<std::int64_t>(extents_.offset(entry.extent));
  const SwapState state = entry.state;
  std::unique_ptr<Error> error;
  lock.unlock();
  try {
    engine_->wait(entry.io);
    // The caller's buffer is not touched by any other call until this returns.
    if (state == SwapState::kReading) verify(id, entry, offset);
  } catch (const Error& e) {
    error = std::make_unique<Error>(e);
  }
  lock.lock();
  // The file may have been replaced between the check before submit and the
  // engine's open: then the bytes went to, or came from, another file.
  if (!error) {
    try {
      check_file();
    } catch (const Error& e) {
      error = std::make_unique<Error>(e);
    }
  }
  // The entry cannot have gone: release() and swap_out() refuse ids in flight.
  Entry& e = entries_.at(id);
  if (error && state == SwapState::kWriting) {
    extents_.free(e.extent);
    entries_.erase(id);
  } else {
    e.state = SwapState::kOnDisk;
  }
  if (error) throw *error;
  (state == SwapState::kWriting ? bytes_out_ : bytes_in_) += static_cast<std::uint64_t>(e.bytes);
  if (lost_) throw *lost_;  // waited for (the caller may free its buffer), but the bytes are gone
}

void SwapManager::verify(SwapId id, const Entry& entry, std::int64_t offset) const {
  const std::uint64_t found = checksum(entry.destination, entry.bytes);
  if (found == entry.checksum) return;
  throw Error(StatusCode::kSwapCorrupted,
              "swap-in of id " + std::to_string(id) + " read " + std::to_string(entry.bytes) +
                  " bytes at offset " + std::to_string(offset) + " of " + path() +
                  " that differ from the bytes swapped out (xxh3 " + hex(found) + ", expected " +
                  hex(entry.checksum) +
                  "): the swap file was written by something else, or the disk returned other "
                  "bytes. The tensor's contents are lost; keep swap directories private to one job",
              {{"id", id}, {"path", path()}, {"offset", offset}, {"bytes", entry.bytes}});
}

void SwapManager::wait(SwapId id) {
  std::unique_lock<std::mutex> lock(mutex_);
  wait_unlocked(id, lock);
}

void SwapManager::wait_all() {
  std::unique_lock<std::mutex> lock(mutex_);
  check_open();
  std::vector<SwapId> busy;
  for (const auto& [id, e] : entries_) {
    if (e.state != SwapState::kOnDisk) busy.push_back(id);
  }
  std::unique_ptr<Error> first;
  for (SwapId id : busy) {
    try {
      wait_unlocked(id, lock);
    } catch (const Error& e) {
      if (!first) first = std::make_unique<Error>(e);
    }
  }
  if (first) throw *first;
}

void SwapManager::release(SwapId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable();
  const Entry& e = find(id);
  if (e.state != SwapState::kOnDisk) {
    throw Error(StatusCode::kInvalidArgument,
                "swap id " + std::to_string(id) + " has I/O in flight (" +
                    swap_state_name(e.state) + "); wait(id) before releasing it",
                {{"id", id}});
  }
  extents_.free(e.extent);
  entries_.erase(id);
}

bool SwapManager::contains(SwapId id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable();
  return entries_.count(id) != 0;
}

SwapState SwapManager::state(SwapId id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable();
  return find(id).state;
}

SwapExtent SwapManager::extent(SwapId id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable();
  const Entry& e = find(id);
  return {extents_.offset(e.extent), static_cast<std::uint64_t>(e.bytes)};
}

std::vector<SwapId> SwapManager::ids() const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable();
  std::vector<SwapId> out;
  for (const auto& entry : entries_) out.push_back(entry.first);
  return out;
}

SwapStats SwapManager::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const AllocatorStats a = extents_.stats();
  return {a.capacity, a.used, a.largest_free, entries_.size(), bytes_out_, bytes_in_,
          file_.leftover_bytes_removed()};
}

void SwapManager::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  closed_ = true;
  // The engine's destructor waits for I/O still in flight on the callers' buffers.
  engine_.reset();
  entries_.clear();
  file_.close();
}

}  // namespace zcore
