// Note "O_DIRECT alignment".
// O_DIRECT transfers need the memory address, the file offset and the length
// aligned to the logical sector size; zcore uses kIoAlignment (the page size)
// for all three. plan_blocks() cuts a request [offset, offset + bytes) at the
// first and last aligned boundaries inside it:
//   head   [offset, round_up(offset))      partial first sector
//   middle [round_up(offset), round_down(end))  whole sectors
//   tail   [round_down(end), end)          partial last sector
// Reads fetch the whole sector of head and tail into a bounce buffer and copy
// out the part asked for (reading past the end of file is fine there: the
// kernel returns the bytes up to EOF and submit() checked the file is long
// enough). Writes send head and tail through the page cache instead of a
// read-modify-write of the sector: the kernel then merges them with the
// neighbouring bytes, concurrent requests that share a sector cannot lose
// each other's bytes, and the file never grows past `end`; the kernel keeps
// page cache and O_DIRECT coherent (direct reads flush dirty pages first,
// direct writes invalidate them), and the request is fdatasync'ed before it
// completes so a write error surfaces in wait(). The middle goes straight to
// the caller's buffer when its address is aligned there (address and offset
// congruent modulo kIoAlignment), else through bounce buffers.
#include "zcore/aio_engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include "aio_internal.h"

namespace zcore {
namespace {

std::int64_t round_down(std::int64_t v) { return v / kIoAlignment * kIoAlignment; }
std::int64_t round_up(std::int64_t v) { return round_down(v + kIoAlignment - 1); }

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// Bytes an unprivileged writer can still use on the filesystem of `path` (of
// its directory when the file is not there: a create that failed), or -1
// when the filesystem cannot be asked.
std::int64_t free_bytes(const std::string& path) {
  struct statvfs fs {};
  if (::statvfs(path.c_str(), &fs) != 0) {
    const auto slash = path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, std::max<std::size_t>(slash, 1));
    if (::statvfs(dir.c_str(), &fs) != 0) return -1;
  }
  return static_cast<std::int64_t>(fs.f_bavail) * static_cast<std::int64_t>(fs.f_frsize);
}

// aio::io_error, where the request that failed is `required` bytes long (its
// transfer that failed may be a block of it). ENOSPC also names the bytes the
// request needs and those free on the filesystem (statvfs at the failure).
Error transfer_error(const char* what, const std::string& path, std::int64_t offset, std::int64_t bytes,
                     int err, std::int64_t required) {
  std::vector<std::pair<std::string, ErrorDetail>> details{
      {"path", path}, {"offset", offset}, {"bytes", bytes}, {"errno", std::int64_t{err}}};
  std::string message = std::string(what) + " of " + std::to_string(bytes) + " bytes at offset " +
                        std::to_string(offset) + " of " + path + " failed: " + errno_text(err);
  if (err != ENOSPC && err != EDQUOT && err != EFBIG) {
    return Error(StatusCode::kIoError, message, std::move(details));
  }
  const std::int64_t available = err == ENOSPC ? free_bytes(path) : -1;
  if (available >= 0) {
    message += "; the request needs " + std::to_string(required) + " bytes, its filesystem has " +
               std::to_string(available) + " bytes free";
    details.emplace_back("required", required);
    details.emplace_back("available", available);
  }
  message += "; free space on that filesystem or choose another directory";
  return Error(StatusCode::kNoSpace, message, std::move(details));
}

void check_config(const AioConfig& c) {
  if (c.block_size <= 0 || c.block_size % kIoAlignment != 0) {
    throw Error(StatusCode::kInvalidArgument,
                "block_size must be a positive multiple of " + std::to_string(kIoAlignment) +
                    " bytes, got " + std::to_string(c.block_size),
                {{"block_size", c.block_size}});
  }
  if (c.queue_depth < 1 || c.queue_depth > 1024) {
    throw Error(StatusCode::kInvalidArgument,
                "queue_depth must be in [1, 1024], got " + std::to_string(c.queue_depth),
                {{"queue_depth", std::int64_t{c.queue_depth}}});
  }
  if (c.threads < 1 || c.threads > 64) {
    throw Error(StatusCode::kInvalidArgument,
                "threads must be in [1, 64], got " + std::to_string(c.threads),
                {{"threads", std::int64_t{c.threads}}});
  }
}

// Largest end (offset + bytes) of a request: round_up() of any end stays
// representable, and no file on Linux can reach it anyway (off_t is int64).
constexpr std::int64_t kMaxRequestEnd = std::numeric_limits<std::int64_t>::max() / kIoAlignment * kIoAlignment;

const char* file_type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

Error not_a_regular_file(const std::string& path, mode_t mode) {
  return Error(StatusCode::kInvalidArgument,
               path + " is " + file_type_name(mode) +
                   ": the I/O engine reads and writes regular files only; give the path of one",
               {{"path", path}});
}

// Opens a regular file without blocking: O_NONBLOCK keeps the open of a FIFO
// (or device) from waiting for a peer, and fstat on the descriptor then
// refuses anything but a regular file (no race between checking and opening).
int open_regular(const std::string& path, int flags, std::int64_t offset, std::int64_t bytes) {
  const int fd = ::open(path.c_str(), flags | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    struct stat st {};
    // A write-only open of a FIFO fails (ENXIO), as does one of a directory
    // (EISDIR): name the file's kind rather than the errno.
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) throw not_a_regular_file(path, st.st_mode);
    errno = err;
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw aio::io_error("fstat", path, offset, bytes, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw not_a_regular_file(path, st.st_mode);
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

// Opens `path`, with O_DIRECT when `direct`; falls back to the page cache when
// the filesystem refuses O_DIRECT (EINVAL). Returns the fd and whether it is direct.
std::pair<int, bool> open_file(const std::string& path, int flags, bool direct, std::int64_t offset,
                               std::int64_t bytes) {
  if (direct) {
    const int fd = open_regular(path, flags | O_DIRECT, offset, bytes);
    if (fd >= 0) return {fd, true};
    if (errno != EINVAL) {
      throw aio::io_error("open", path, offset, bytes, errno);
    }
  }
  const int fd = open_regular(path, flags, offset, bytes);
  if (fd < 0) throw aio::io_error("open", path, offset, bytes, errno);
  return {fd, false};
}

class ThreadPoolEngine final : public aio::QueuedEngine {
 public:
  ThreadPoolEngine(const AioConfig& config, std::string reason)
      : QueuedEngine(config, IoBackend::kThreadPool, std::move(reason)) {
    for (int i = 0; i < config.threads; ++i) workers_.emplace_back([this] { run(); });
  }
  ~ThreadPoolEngine() override {
    stop_workers();
    for (auto& t : workers_) t.join();
  }

 private:
  void run() {
    std::vector<aio::Work> taken;
    for (;;) {
      taken.clear();
      take(taken, 1, true);
      if (taken.empty()) return;
      aio::Work& w = taken.front();
      if (skip_if_failed(w)) continue;
      std::int64_t result;
      do {
        const bool read = w.request->io.op == IoOp::kRead;
        const auto n = static_cast<std::size_t>(w.remaining());
        const ssize_t rc = read ? ::pread(w.fd(), w.target(nullptr), n, w.position())
                                : ::pwrite(w.fd(), w.target(nullptr), n, w.position());
        result = rc < 0 ? -errno : rc;
      } while (result == -EINTR || on_transfer(w, result, nullptr));
    }
  }

  std::vector<std::thread> workers_;
};

}  // namespace

namespace aio {

Error io_error(const char* what, const std::string& path, std::int64_t offset, std::int64_t bytes,
               int err) {
  return transfer_error(what, path, offset, bytes, err, bytes);
}

std::vector<Block> plan_blocks(IoOp op, std::uintptr_t buffer, std::int64_t offset,
                               std::int64_t bytes, std::int64_t block_size, bool direct) {
  std::vector<Block> out;
  auto chunked = [&](BlockMode mode, std::int64_t begin, std::int64_t end) {
    for (std::int64_t b = begin; b < end; b += block_size) {
      out.push_back({mode, b, std::min(block_size, end - b)});
    }
  };
  const std::int64_t end = offset + bytes;
  if (!direct) {
    chunked(BlockMode::kPageCache, offset, end);
    return out;
  }
  const std::int64_t head_end = std::min(round_up(offset), end);
  const std::int64_t tail_begin = std::max(round_down(end), head_end);
  const bool read = op == IoOp::kRead;
  if (head_end > offset) {
    out.push_back(read ? Block{BlockMode::kBounce, round_down(offset), kIoAlignment}
                       : Block{BlockMode::kPageCache, offset, head_end - offset});
  }
  const std::uintptr_t middle_address = buffer + static_cast<std::uintptr_t>(head_end - offset);
  const bool aligned = middle_address % static_cast<std::uintptr_t>(kIoAlignment) == 0;
  chunked(aligned ? BlockMode::kDirect : BlockMode::kBounce, head_end, tail_begin);
  if (tail_begin < end) {
    out.push_back(read ? Block{BlockMode::kBounce, tail_begin, kIoAlignment}
                       : Block{BlockMode::kPageCache, tail_begin, end - tail_begin});
  }
  return out;
}

Request::~Request() {
  if (direct_fd >= 0) ::close(direct_fd);
  if (cached_fd >= 0 && cached_fd != direct_fd) ::close(cached_fd);
}

int Work::fd() const {
  return block.mode == BlockMode::kPageCache ? request->cached_fd : request->direct_fd;
}

unsigned char* Work::target(unsigned char* bounce) const {
  if (block.mode == BlockMode::kBounce) return bounce + transferred;
  auto* user = static_cast<unsigned char*>(request->io.buffer);
  return user + (block.file_offset - request->io.offset) + transferred;
}

QueuedEngine::QueuedEngine(const AioConfig& config, IoBackend backend, std::string reason)
    : config_(config), backend_(backend), reason_(std::move(reason)) {}

IoHandle QueuedEngine::submit(const IoRequest& io) {
  if (io.buffer == nullptr || io.bytes <= 0 || io.offset < 0 || io.path.empty()) {
    throw Error(StatusCode::kInvalidArgument,
                "an I/O request needs a buffer, bytes > 0, offset >= 0 and a path; got bytes=" +
                    std::to_string(io.bytes) + ", offset=" + std::to_string(io.offset) +
                    ", path='" + io.path + "'",
                {{"bytes", io.bytes}, {"offset", io.offset}, {"path", io.path}});
  }
  if (io.bytes > kMaxRequestEnd - io.offset) {
    throw Error(StatusCode::kInvalidArgument,
                "an I/O request of " + std::to_string(io.bytes) + " bytes at offset " +
                    std::to_string(io.offset) + " of " + io.path + " ends past the largest file offset (" +
                    std::to_string(kMaxRequestEnd) + " bytes)",
                {{"bytes", io.bytes}, {"offset", io.offset}, {"path", io.path}});
  }
  auto r = std::make_shared<Request>();
  r->io = io;
  const bool read = io.op == IoOp::kRead;
  const bool want_direct = backend_ == IoBackend::kLibaio;
  const auto [fd, direct] =
      open_file(io.path, read ? O_RDONLY : (O_WRONLY | O_CREAT), want_direct, io.offset, io.bytes);
  (direct ? r->direct_fd : r->cached_fd) = fd;
  if (read) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw io_error("fstat", io.path, io.offset, io.bytes, errno);
    if (st.st_size < io.offset + io.bytes) {
      throw Error(StatusCode::kFileTooSmall,
                  "cannot read " + std::to_string(io.bytes) + " bytes at offset " +
                      std::to_string(io.offset) + " of " + io.path + ": the file has only " +
                      std::to_string(st.st_size) + " bytes",
                  {{"path", io.path},
                   {"offset", io.offset},
                   {"bytes", io.bytes},
                   {"file_size", static_cast<std::int64_t>(st.st_size)}});
    }
  }
  std::vector<Block> blocks = plan_blocks(io.op, reinterpret_cast<std::uintptr_t>(io.buffer),
                                          io.offset, io.bytes, config_.block_size, direct);
  const bool page_cache = std::any_of(blocks.begin(), blocks.end(), [](const Block& b) {
    return b.mode == BlockMode::kPageCache;
  });
  if (page_cache && r->cached_fd < 0) {
    r->cached_fd = open_file(io.path, O_WRONLY, false, io.offset, io.bytes).first;
  }
  r->sync_on_finish = !read && page_cache;
  r->outstanding.store(static_cast<std::int64_t>(blocks.size()));

  IoHandle handle;
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    handle = next_handle_++;
    requests_.emplace(handle, r);
  }
  requests_total_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    for (const Block& b : blocks) queue_.push_back(Work{r, b, 0});
  }
  queue_cv_.notify_all();
  return handle;
}

std::shared_ptr<Request> QueuedEngine::find_locked(IoHandle handle) const {
  const auto it = requests_.find(handle);
  if (it == requests_.end()) {
    throw Error(StatusCode::kInvalidHandle,
                "I/O handle " + std::to_string(handle) + " is unknown or was already waited for",
                {{"handle", static_cast<std::int64_t>(handle)}});
  }
  return it->second;
}

bool QueuedEngine::poll(IoHandle handle) {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return find_locked(handle)->done;
}

void QueuedEngine::wait(IoHandle handle) {
  std::shared_ptr<Request> r;
  {
    std::unique_lock<std::mutex> lock(state_mutex_);
    r = find_locked(handle);
    done_cv_.wait(lock, [&] { return r->done; });
    requests_.erase(handle);
  }
  if (r->error) throw *r->error;
}

void QueuedEngine::wait_all() {
  std::vector<std::pair<IoHandle, std::shared_ptr<Request>>> all;
  {
    std::unique_lock<std::mutex> lock(state_mutex_);
    all.assign(requests_.begin(), requests_.end());
    requests_.clear();
    done_cv_.wait(lock, [&] {
      return std::all_of(all.begin(), all.end(), [](const auto& e) { return e.second->done; });
    });
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [handle, r] : all) {
    if (r->error) throw *r->error;
  }
}

std::int64_t QueuedEngine::pending() const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return static_cast<std::int64_t>(requests_.size());
}

AioStats QueuedEngine::stats() const {
  AioStats s;
  s.requests = requests_total_.load();
  s.bytes_read = bytes_read_.load();
  s.bytes_written = bytes_written_.load();
  s.bounce_bytes = bounce_bytes_.load();
  s.page_cache_bytes = page_cache_bytes_.load();
  return s;
}

void QueuedEngine::take(std::vector<Work>& out, std::size_t max, bool block) {
  std::unique_lock<std::mutex> lock(queue_mutex_);
  if (block) queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
  while (out.size() < max && !queue_.empty()) {
    out.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
}

void QueuedEngine::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
}

bool QueuedEngine::skip_if_failed(Work& work) {
  if (!work.request->failed.load()) return false;
  finish_block(work);
  return true;
}

void QueuedEngine::fill_bounce(const Work& work, unsigned char* bounce) const {
  const IoRequest& io = work.request->io;
  const std::int64_t begin = std::max(work.block.file_offset, io.offset);
  const std::int64_t end = std::min(work.block.file_offset + work.block.length, io.offset + io.bytes);
  std::memcpy(bounce + (begin - work.block.file_offset),
              static_cast<const unsigned char*>(io.buffer) + (begin - io.offset),
              static_cast<std::size_t>(end - begin));
}

bool QueuedEngine::on_transfer(Work& work, std::int64_t result, const unsigned char* bounce) {
  Request& r = *work.request;
  const IoRequest& io = r.io;
  const bool read = io.op == IoOp::kRead;
  const Block& b = work.block;
  if (result < 0) {
    fail(r, transfer_error(read ? "read" : "write", io.path, work.position(), work.remaining(),
                           static_cast<int>(-result), io.bytes));
    finish_block(work);
    return false;
  }
  work.transferred += result;
  // Caller's bytes covered by this block; a bounce read of the last sector
  // needs only the bytes up to the request's end (the file may end there).
  const std::int64_t begin = std::max(b.file_offset, io.offset);
  const std::int64_t end = std::min(b.file_offset + b.length, io.offset + io.bytes);
  const std::int64_t needed = read && b.mode == BlockMode::kBounce ? end - b.file_offset : b.length;
  if (work.transferred >= needed) {
    if (read && b.mode == BlockMode::kBounce) {
      std::memcpy(static_cast<unsigned char*>(io.buffer) + (begin - io.offset),
                  bounce + (begin - b.file_offset), static_cast<std::size_t>(end - begin));
    }
    const auto n = static_cast<std::uint64_t>(end - begin);
    (read ? bytes_read_ : bytes_written_).fetch_add(n);
    if (b.mode == BlockMode::kBounce) bounce_bytes_.fetch_add(n);
    if (b.mode == BlockMode::kPageCache) page_cache_bytes_.fetch_add(n);
    finish_block(work);
    return false;
  }
  // A short transfer resumes where it stopped, unless nothing moved (end of
  // file for a read) or O_DIRECT cannot continue from an unaligned position.
  const bool resumable =
      result > 0 && (b.mode == BlockMode::kPageCache || work.transferred % kIoAlignment == 0);
  if (resumable) return true;
  if (read) {
    const std::int64_t at = work.position();
    fail(r, Error(StatusCode::kShortRead,
                  "short read of " + io.path + ": the file ended at offset " + std::to_string(at) +
                      " while reading " + std::to_string(io.bytes) + " bytes at offset " +
                      std::to_string(io.offset) + " (was it truncated while the read was pending?)",
                  {{"path", io.path},
                   {"offset", at},
                   {"bytes", io.bytes},
                   {"request_offset", io.offset}}));
  } else {
    fail(r, transfer_error("write", io.path, work.position(), work.remaining(), result > 0 ? EIO : ENOSPC,
                           io.bytes));
  }
  finish_block(work);
  return false;
}

void QueuedEngine::abandon(Work& work, Error error) {
  fail(*work.request, std::move(error));
  finish_block(work);
}

void QueuedEngine::fail(Request& r, Error error) {
  if (!r.failed.exchange(true)) r.error = std::make_unique<Error>(std::move(error));
}

void QueuedEngine::finish_block(Work& work) {
  std::shared_ptr<Request> r = std::move(work.request);
  if (r->outstanding.fetch_sub(1) == 1) finish_request(*r);
}

void QueuedEngine::finish_request(Request& r) {
  if (r.sync_on_finish && !r.failed.load() && ::fdatasync(r.cached_fd) != 0) {
    fail(r, io_error("fdatasync after write", r.io.path, r.io.offset, r.io.bytes, errno));
  }
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    r.done = true;
  }
  done_cv_.notify_all();
}

}  // namespace aio

const char* io_backend_name(IoBackend backend) {
  switch (backend) {
    case IoBackend::kAuto: return "auto";
    case IoBackend::kLibaio: return "libaio";
    case IoBackend::kThreadPool: return "threadpool";
  }
  return "unknown";
}

bool libaio_compiled() {
#if defined(ZCORE_WITH_LIBAIO)
  return true;
#else
  return false;
#endif
}

std::string direct_io_unsupported_reason(const std::string& directory) {
  std::string path = directory + "/.zcore-direct-io-probe-XXXXXX";
  const int tmp = ::mkstemp(path.data());
  // A directory that cannot take a file says nothing about O_DIRECT (reads
  // may still work); each request falls back on its own if O_DIRECT is refused.
  if (tmp < 0) return "";
  ::close(tmp);
  std::string reason;
  const int fd = ::open(path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
  if (fd < 0) {
    reason = "the filesystem of " + directory + " refuses O_DIRECT: " + errno_text(errno);
  } else {
    void* block = nullptr;
    if (posix_memalign(&block, kIoAlignment, kIoAlignment) != 0) {
      reason = "no memory for the O_DIRECT probe";
    } else {
      std::memset(block, 0, kIoAlignment);
      if (::pwrite(fd, block, kIoAlignment, 0) != kIoAlignment ||
          ::pread(fd, block, kIoAlignment, 0) != kIoAlignment) {
        reason = "O_DIRECT I/O fails on the filesystem of " + directory + ": " + errno_text(errno);
      }
      std::free(block);
    }
    ::close(fd);
  }
  ::unlink(path.c_str());
  return reason;
}

std::unique_ptr<AioEngine> AioEngine::create(const AioConfig& config) {
  check_config(config);
  if (config.backend == IoBackend::kThreadPool) {
    return std::make_unique<ThreadPoolEngine>(config, "thread pool requested");
  }
  const bool required = config.backend == IoBackend::kLibaio;
#if defined(ZCORE_WITH_LIBAIO)
  if (!config.probe_directory.empty()) {
    const std::string why = direct_io_unsupported_reason(config.probe_directory);
    if (!why.empty()) {
      if (required) {
        throw Error(StatusCode::kInvalidArgument,
                    "the libaio backend was requested but " + why +
                        "; use backend='auto' or another directory",
                    {{"path", config.probe_directory}});
      }
      return std::make_unique<ThreadPoolEngine>(config, why);
    }
  }
  try {
    return aio::make_libaio_engine(config, "libaio with O_DIRECT");
  } catch (const Error& e) {
    if (required) throw;
    return std::make_unique<ThreadPoolEngine>(config, e.what());
  }
#else
  if (required) {
    throw Error(StatusCode::kInvalidArgument,
                "the libaio backend was requested but zcore was built without libaio "
                "(ZCORE_AIO=THREADPOOL); install libaio-dev and rebuild, or use backend='auto'");
  }
  return std::make_unique<ThreadPoolEngine>(config, "zcore was built without libaio");
#endif
}

}  // namespace zcore
