// Internals of the I/O engine shared by its two backends (aio_engine.cpp:
// bookkeeping and the thread pool; aio_libaio.cpp: the libaio workers).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "zcore/aio_engine.h"
#include "zcore/status.h"

namespace zcore::aio {

enum class BlockMode {
  kDirect,     // O_DIRECT straight from/into the caller's buffer
  kBounce,     // O_DIRECT through an aligned bounce buffer
  kPageCache,  // pread/pwrite without O_DIRECT on the caller's buffer
};

struct Block {
  BlockMode mode;
  std::int64_t file_offset;  // where the transfer starts (aligned unless kPageCache)
  std::int64_t length;       // bytes transferred (aligned unless kPageCache)
};

// Splits a request into blocks of at most `block_size` bytes (see the note
// "O_DIRECT alignment" in aio_engine.cpp). `direct`: the file is open with
// O_DIRECT; otherwise every block is kPageCache.
std::vector<Block> plan_blocks(IoOp op, std::uintptr_t buffer, std::int64_t offset,
                               std::int64_t bytes, std::int64_t block_size, bool direct);

struct Request {
  ~Request();

  IoRequest io;
  int direct_fd = -1;  // O_DIRECT descriptor, -1 when the file refused O_DIRECT
  int cached_fd = -1;  // descriptor through the page cache, -1 when no block needs it
  bool sync_on_finish = false;  // written through the page cache: fdatasync before done
  std::atomic<std::int64_t> outstanding{0};  // blocks not yet finished
  std::atomic<bool> failed{false};
  std::unique_ptr<Error> error;  // written once, by whoever sets `failed` first
  bool done = false;             // guarded by the engine's state mutex
};

// One block of a request on its way through a worker.
struct Work {
  std::shared_ptr<Request> request;
  Block block{};
  std::int64_t transferred = 0;  // bytes of the block done so far (short I/O resumes)

  int fd() const;
  std::int64_t position() const { return block.file_offset + transferred; }
  std::int64_t remaining() const { return block.length - transferred; }
  // Where the next transfer reads or writes memory: the caller's buffer, or
  // `bounce` (block_size bytes, aligned) for kBounce blocks.
  unsigned char* target(unsigned char* bounce) const;
};

// Request bookkeeping, the shared block queue and completion handling; the
// backends only move bytes.
class QueuedEngine : public AioEngine {
 public:
  IoHandle submit(const IoRequest& request) override;
  bool poll(IoHandle handle) override;
  void wait(IoHandle handle) override;
  void wait_all() override;
  std::int64_t pending() const override;
  IoBackend backend() const override { return backend_; }
  const std::string& backend_reason() const override { return reason_; }
  const AioConfig& config() const override { return config_; }
  AioStats stats() const override;

 protected:
  QueuedEngine(const AioConfig& config, IoBackend backend, std::string reason);

  // Moves up to `max` blocks into `out`. With `block`, waits for work and
  // returns nothing only once stop_workers() was called and the queue is empty.
  void take(std::vector<Work>& out, std::size_t max, bool block);
  // Finishes a block of a request that already failed without doing its I/O.
  bool skip_if_failed(Work& work);
  // Copies the caller's bytes into the bounce buffer of a kBounce write.
  void fill_bounce(const Work& work, unsigned char* bounce) const;
  // Accounts one transfer of `result` bytes (negative: -errno). Returns true
  // when the block must be resubmitted for its remaining bytes; otherwise the
  // block is finished (and its request too, when it was the last one).
  bool on_transfer(Work& work, std::int64_t result, const unsigned char* bounce);
  // Finishes a block with `error` (e.g. no bounce buffer could be allocated).
  void abandon(Work& work, Error error);
  // Lets workers return from take() once the queue is drained.
  void stop_workers();

 private:
  std::shared_ptr<Request> find_locked(IoHandle handle) const;  // holds state_mutex_
  void fail(Request& r, Error error);
  void finish_block(Work& work);
  void finish_request(Request& r);

  const AioConfig config_;
  const IoBackend backend_;
  const std::string reason_;

  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<Work> queue_;
  bool stopping_ = false;

  mutable std::mutex state_mutex_;  // requests_, Request::done, next_handle_
  std::condition_variable done_cv_;
  std::unordered_map<IoHandle, std::shared_ptr<Request>> requests_;
  IoHandle next_handle_ = 1;

  std::atomic<std::uint64_t> requests_total_{0};
  std::atomic<std::uint64_t> bytes_read_{0};
  std::atomic<std::uint64_t> bytes_written_{0};
  std::atomic<std::uint64_t> bounce_bytes_{0};
  std::atomic<std::uint64_t> page_cache_bytes_{0};
};

// The I/O error of a failed transfer: kNoSpace for ENOSPC/EDQUOT/EFBIG,
// kIoError otherwise.
Error io_error(const char* what, const std::string& path, std::int64_t offset, std::int64_t bytes,
               int err);

#if defined(ZCORE_WITH_LIBAIO)
// Throws Error(kSystemError) when io_setup fails (no kernel AIO, aio-max-nr).
std::unique_ptr<AioEngine> make_libaio_engine(const AioConfig& config, std::string reason);
#endif

}  // namespace zcore::aio
