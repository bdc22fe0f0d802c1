// Asynchronous file I/O engine for NVMe offload.
//
// A request (buffer, path, offset, bytes, read or write) is split into blocks
// of `block_size` bytes that worker threads keep in flight. Two backends:
//
// - libaio: each of `threads` workers owns one io context (created once) and
//   keeps up to `queue_depth` blocks in flight with O_DIRECT, submitting a new
//   block as soon as one completes, so the device queue never drains while
//   work remains.
// - thread pool: `threads` workers doing pread/pwrite through the page cache.
//   Used where libaio is not compiled in (ZCORE_AIO=THREADPOOL), where
//   io_setup fails, or where the filesystem refuses O_DIRECT (tmpfs).
//
// Alignment (see the note "O_DIRECT alignment" in aio_engine.cpp): O_DIRECT
// needs buffer address, file offset and length aligned to kIoAlignment. Any
// request is accepted: unaligned head and tail sectors are read through
// aligned bounce buffers, and written through the page cache (then flushed
// with fdatasync before the request completes); a buffer whose address is not
// congruent to the offset goes through bounce buffers entirely.
//
// Error contract: a request's failure is raised by wait() as zcore::Error
// with the path, the offset and errno in its details:
//   kNoSpace       ENOSPC / EDQUOT / EFBIG on a write; ENOSPC also names
//                  `required` (the request's bytes) and `available` (bytes
//                  free on the filesystem when it failed, from statvfs)
//   kIoError       any other failed read or write (EIO, ...), or open failure
//   kShortRead     the file ended before the bytes asked for (truncated under
//                  a pending read)
//   kFileTooSmall  raised by submit(): a read asks for bytes past the end
// A write that failed in any block never reports success; after a failed
// read the buffer's contents are unspecified (never reported as valid).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace zcore {

// O_DIRECT granularity used for buffers, offsets and lengths: the page size,
// which is a multiple of every logical sector size in use (512, 4096).
constexpr std::int64_t kIoAlignment = 4096;

enum class IoOp { kRead, kWrite };

enum class IoBackend {
  kAuto,        // libaio when compiled in, io_setup works and O_DIRECT works in
                // the probe directory; otherwise the thread pool
  kLibaio,      // libaio + O_DIRECT, or an error saying why it cannot be used
  kThreadPool,  // pread/pwrite on worker threads through the page cache
};

const char* io_backend_name(IoBackend backend);

// Whether this build contains the libaio backend.
bool libaio_compiled();

// Why O_DIRECT cannot be used for files in `directory` (probed by writing and
// reading one aligned block of a temporary file), or "" when it can or when
// no probe file can be created there.
std::string direct_io_unsupported_reason(const std::string& directory);

struct AioConfig {
  std::int64_t block_size = 1 << 20;  // bytes per submitted I/O; multiple of kIoAlignment
  int queue_depth = 32;               // blocks in flight per worker (libaio)
  int threads = 1;                    // workers, each with its own io context
  IoBackend backend = IoBackend::kAuto;
  // Directory whose filesystem decides kAuto (O_DIRECT support); empty: only
  // whether libaio works is considered.
  std::string probe_directory;
};

struct IoRequest {
  IoOp op = IoOp::kRead;
  void* buffer = nullptr;  // host memory, valid until the request completes
  std::int64_t bytes = 0;  // > 0
  std::string path;        // opened per request (created for writes, never truncated)
  std::int64_t offset = 0;
};

using IoHandle = std::uint64_t;

struct AioStats {
  std::uint64_t requests = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t bounce_bytes = 0;      // moved through bounce buffers (alignment)
  std::uint64_t page_cache_bytes = 0;  // written or read without O_DIRECT
};

class AioEngine {
 public:
  // Validates the config (kInvalidArgument naming the field) and starts the
  // workers of the chosen backend.
  static std::unique_ptr<AioEngine> create(const AioConfig& config);

  // Waits for every request still in flight (their buffers are in use by the
  // kernel) and discards their status.
  virtual ~AioEngine() = default;
  AioEngine(const AioEngine&) = delete;
  AioEngine& operator=(const AioEngine&) = delete;

  // Opens the file and queues the request. Throws kInvalidArgument (bytes,
  // offset, buffer), kIoError (open failed) or kFileTooSmall (read past EOF).
  virtual IoHandle submit(const IoRequest& request) = 0;
  // True once the request has finished (successfully or not). kInvalidHandle
  // for a handle that is unknown or already waited for.
  virtual bool poll(IoHandle handle) = 0;
  // Blocks until the request finishes, forgets the handle, and throws the
  // request's error if it failed.
  virtual void wait(IoHandle handle) = 0;
  // Waits for every request not yet waited for, forgets them all, and throws
  // the first failure among them (by handle order).
  virtual void wait_all() = 0;
  // Requests submitted and not yet waited for.
  virtual std::int64_t pending() const = 0;

  // The backend in use (never kAuto) and why it was chosen.
  virtual IoBackend backend() const = 0;
  virtual const std::string& backend_reason() const = 0;
  virtual const AioConfig& config() const = 0;
  virtual AioStats stats() const = 0;

 protected:
  AioEngine() = default;
};

}  // namespace zcore
