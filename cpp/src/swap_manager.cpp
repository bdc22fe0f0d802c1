#include "zcore/swap_manager.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <random>
#include <utility>

#include "zcore/status.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace zcore {
namespace {

std::uint64_t checksum(const void* data, std::int64_t bytes) {
  return XXH3_64bits(data, static_cast<std::size_t>(bytes));
}

std::string hex(std::uint64_t v) {
  static const char* digits = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) out[static_cast<std::size_t>(i)] = digits[v & 0xf];
  return out;
}

std::int64_t round_up(std::int64_t v) { return (v + kIoAlignment - 1) / kIoAlignment * kIoAlignment; }

Error directory_error(const std::string& what, const std::string& path, int err) {
  return Error(StatusCode::kIoError,
               "swap directory unusable: " + what + " " + path + ": " + std::strerror(err) +
                   " (errno " + std::to_string(err) +
                   "); give a directory this process can write to",
               {{"path", path}, {"errno", std::int64_t{err}}});
}

// Letters, digits and '_': what a swap name may hold ('-' separates the parts
// of a file name).
bool is_word_char(char ch) {
  return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_';
}

constexpr std::size_t kMaxNameLength = 64;
constexpr std::size_t kMaxHostLength = 32;
constexpr int kCreateAttempts = 8;
const std::string kPrefix = "zcore-swap-";
const std::string kSuffix = ".swp";

bool is_swap_file_name(const std::string& name) {
  return name.size() >= kPrefix.size() + kSuffix.size() && name.compare(0, kPrefix.size(), kPrefix) == 0 &&
         name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0;
}

bool same_file(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

// The host name as a file-name part: [A-Za-z0-9_-], at most kMaxHostLength.
std::string host_tag() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) buf[0] = '\0';
  std::string out;
  for (const char* p = buf; *p != '\0' && out.size() < kMaxHostLength; ++p) {
    out += is_word_char(*p) || *p == '-' ? *p : '_';
  }
  return out.empty() ? "unknown" : out;
}

// Whether `name` (a swap file's) was made by a process of this host that is
// still running: at most a file its creator has not locked yet (note "swap
// file ownership"), never a leftover. Names: ...-<host>-<pid>-<random>.swp.
bool made_by_a_live_local_process(const std::string& name) {
  const std::string body = name.substr(0, name.size() - kSuffix.size());
  const std::size_t random_dash = body.rfind('-');
  if (random_dash == std::string::npos || random_dash == 0) return false;
  const std::size_t pid_dash = body.rfind('-', random_dash - 1);
  if (pid_dash == std::string::npos) return false;
  const std::string pid = body.substr(pid_dash + 1, random_dash - pid_dash - 1);
  if (pid.empty() || pid.size() > 9 ||
      !std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  const std::string host = "-" + host_tag();
  if (pid_dash < host.size() || body.compare(pid_dash - host.size(), host.size(), host) != 0) return false;
  const auto owner = static_cast<pid_t>(std::stol(pid));
  return owner > 0 && (::kill(owner, 0) == 0 || errno == EPERM);
}

std::uint64_t random_64() {
  try {
    std::random_device device;
    return (std::uint64_t{device()} << 32) ^ device();
  } catch (const std::exception&) {
    // No entropy source: the names stay unique by O_EXCL, only retries get likelier.
    static std::atomic<std::uint64_t> counter{0};
    return static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
           (counter.fetch_add(1) << 40) ^ static_cast<std::uint64_t>(::getpid());
  }
}

// Checks the arguments and that the directory exists, before any file is
// touched, so a bad setting is reported at start-up rather than at the first swap.
SwapConfig checked(const SwapConfig& c) {
  if (c.directory.empty() || c.capacity <= 0 || c.rank < 0) {
    throw Error(StatusCode::kInvalidArgument,
                "a swap manager needs a directory, capacity > 0 and rank >= 0; got directory='" +
                    c.directory + "', capacity=" + std::to_string(c.capacity) +
                    ", rank=" + std::to_string(c.rank),
                {{"path", c.directory}, {"capacity", c.capacity}});
  }
  if (c.name.size() > kMaxNameLength ||
      !std::all_of(c.name.begin(), c.name.end(), [](char ch) { return is_word_char(ch); })) {
    throw Error(StatusCode::kInvalidArgument,
                "swap name '" + c.name + "' is not usable in a file name; give at most " +
                    std::to_string(kMaxNameLength) + " letters, digits and '_' (like \"optimizer\")",
                {{"name", c.name}});
  }
  struct stat st {};
  if (::stat(c.directory.c_str(), &st) != 0) throw directory_error("cannot access", c.directory, errno);
  if (!S_ISDIR(st.st_mode)) throw directory_error("not a directory:", c.directory, ENOTDIR);
  return c;
}

struct Leftovers {
  std::vector<std::string> paths;
  std::uint64_t bytes = 0;
};

// Removes `path` when it is a regular file whose lock nobody holds (note "swap
// file ownership"); returns its size, or -1 when it is left alone.
std::int64_t remove_if_abandoned(const std::string& path) {
  struct stat named {};
  if (::lstat(path.c_str(), &named) != 0 || !S_ISREG(named.st_mode)) return -1;
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return -1;
  std::int64_t removed = -1;
  struct stat locked {};
  // EWOULDBLOCK: a live manager's. Any other failure: left alone too.
  if (::fstat(fd, &locked) == 0 && S_ISREG(locked.st_mode) && same_file(locked, named) &&
      ::flock(fd, LOCK_EX | LOCK_NB) == 0) {
    // Another sweep may have removed it between the open and the lock, and a
    // file moved to this path since is not the one locked.
    struct stat now {};
    if (::fstat(fd, &locked) == 0 && locked.st_nlink > 0 && ::lstat(path.c_str(), &now) == 0 &&
        same_file(now, locked) && ::unlink(path.c_str()) == 0) {
      removed = static_cast<std::int64_t>(locked.st_size);
    }
  }
  ::close(fd);  // releases the lock, after the unlink
  return removed;
}

// Removes the leftover swap files of dead processes from `directory`. A
// directory that cannot be listed is not swept (creating the file still works).
Leftovers remove_leftovers(const std::string& directory) {
  Leftovers out;
  DIR* dir = ::opendir(directory.c_str());
  if (dir == nullptr) return out;
  std::vector<std::string> candidates;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (is_swap_file_name(name) && !made_by_a_live_local_process(name)) {
      candidates.push_back(directory + "/" + name);
    }
  }
  ::closedir(dir);
  for (const std::string& path : candidates) {
    const std::int64_t bytes = remove_if_abandoned(path);
    if (bytes < 0) continue;
    out.paths.push_back(path);
    out.bytes += static_cast<std::uint64_t>(bytes);
  }
  return out;
}

struct OwnedFile {
  std::string path;
  int fd;  // flock(LOCK_EX) held
  struct stat st;
};

Error lock_error(const std::string& path, int err) {
  return Error(StatusCode::kIoError,
               "swap directory unusable: cannot lock the swap file " + path + ": " +
                   std::strerror(err) + " (errno " + std::to_string(err) +
                   "); the lock tells other jobs sharing the directory that the file is in use. "
                   "Use a filesystem with flock (NFS with its lock manager, Lustre mounted with "
                   "-o flock) or a directory on a local disk",
               {{"path", path}, {"errno", std::int64_t{err}}});
}

// Creates the swap file under a new name and locks it (note "swap file ownership").
OwnedFile create_owned_file(const SwapConfig& c) {
  const std::string stem = c.directory + "/" + kPrefix + (c.name.empty() ? "" : c.name + "-") +
                           "rank" + std::to_string(c.rank) + "-" + host_tag() + "-" +
                           std::to_string(::getpid()) + "-";
  std::string path;
  int err = 0;
  for (int attempt = 0; attempt < kCreateAttempts; ++attempt) {
    path = stem + hex(random_64()) + kSuffix;
    const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {
      err = errno;
      if (err == EEXIST) continue;
      throw directory_error("cannot create the swap file", path, err);
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      err = errno;
      ::close(fd);
      if (err == EWOULDBLOCK) continue;  // a sweep took it for a leftover and removes it
      ::unlink(path.c_str());
      throw lock_error(path, err);
    }
    // Until the lock, a sweep may have taken the new file for a leftover and removed it.
    struct stat opened {}, named {};
    if (::fstat(fd, &opened) == 0 && opened.st_nlink > 0 && ::lstat(path.c_str(), &named) == 0 &&
        same_file(opened, named)) {
      return {path, fd, opened};
    }
    err = ENOENT;
    ::close(fd);
  }
  throw directory_error("cannot create a swap file under a new name in " +
                            std::to_string(kCreateAttempts) + " attempts, the last",
                        path, err);
}

// Runs after the leftovers are removed, so their space counts as free. A
// filesystem that reports no size (f_blocks 0: ramfs, some FUSE) reports no
// free space either, and is not checked.
void check_free_space(const SwapConfig& c) {
  struct statvfs fs {};
  if (::statvfs(c.directory.c_str(), &fs) != 0) {
    throw directory_error("cannot query free space of", c.directory, errno);
  }
  if (fs.f_blocks == 0) return;
  const auto available = static_cast<std::int64_t>(fs.f_bavail * fs.f_frsize);
  if (available < c.capacity) {
    throw Error(StatusCode::kNoSpace,
                "swap directory " + c.directory + " has " + std::to_string(available) +
                    " bytes free but rank " + std::to_string(c.rank) + " plans to swap " +
                    std::to_string(c.capacity) +
                    " bytes; free space there, choose another directory or swap less",
                {{"path", c.directory}, {"required", c.capacity}, {"available", available}});
  }
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
    : config_(checked(config)), extents_(round_up(config.capacity)) {
  Leftovers leftovers = remove_leftovers(config_.directory);
  leftovers_ = std::move(leftovers.paths);
  leftover_bytes_ = leftovers.bytes;
  OwnedFile file = create_owned_file(config_);
  path_ = std::move(file.path);
  lock_fd_ = file.fd;
  // The open descriptor also keeps the inode number from being reused by a
  // new file at this path while the manager lives, which check_file() relies on.
  device_ = file.st.st_dev;
  inode_ = file.st.st_ino;
  try {
    check_free_space(config_);
    engine_ = AioEngine::create(engine_config(config_));
  } catch (...) {
    ::unlink(path_.c_str());
    ::close(lock_fd_);
    throw;
  }
}

SwapManager::~SwapManager() { close(); }

const AioEngine& SwapManager::engine() const {
  check_open();
  return *engine_;
}

void SwapManager::check_open() const {
  if (closed_) {
    throw Error(StatusCode::kInvalidArgument,
                "the swap manager of " + path_ + " was closed; create a new one",
                {{"path", path_}});
  }
}

void SwapManager::check_usable() const {
  check_open();
  if (lost_) throw *lost_;
}

void SwapManager::check_file() {
  struct stat st {};
  const bool present = ::stat(path_.c_str(), &st) == 0;
  if (present && st.st_dev == device_ && st.st_ino == inode_) return;
  const auto found = present ? static_cast<std::int64_t>(st.st_ino) : 0;
  lost_ = std::make_unique<Error>(
      StatusCode::kSwapFileLost,
      "the swap file " + path_ + " was " +
          (present ? "replaced by another file (inode " + std::to_string(inode_) + " is now " +
                         std::to_string(found) + ")"
                   : std::string("deleted")) +
          " while " + std::to_string(entries_.size()) +
          " tensors were swapped out to it; their bytes are gone. Keep swap directories away from "
          "tmp cleaners and other jobs, and create a new swap manager",
      std::vector<std::pair<std::string, ErrorDetail>>{
          {"path", path_}, {"inode", static_cast<std::int64_t>(inode_)}, {"found_inode", found}});
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
    io = engine_->submit({IoOp::kWrite, const_cast<void*>(data), bytes, path_, offset});
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
                 {"path", path_}});
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
  e.io = engine_->submit({IoOp::kRead, data, bytes, path_, offset});
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
                  " bytes at offset " + std::to_string(offset) + " of " + path_ +
                  " that differ from the bytes swapped out (xxh3 " + hex(found) + ", expected " +
                  hex(entry.checksum) +
                  "): the swap file was written by something else, or the disk returned other "
                  "bytes. The tensor's contents are lost; keep swap directories private to one job",
              {{"id", id}, {"path", path_}, {"offset", offset}, {"bytes", entry.bytes}});
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
  return {a.capacity, a.used, a.largest_free, entries_.size(), bytes_out_, bytes_in_, leftover_bytes_};
}

void SwapManager::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  closed_ = true;
  // The engine's destructor waits for I/O still in flight on the callers' buffers.
  engine_.reset();
  entries_.clear();
  struct stat st {};
  // A file that replaced ours at this path is someone else's.
  if (::stat(path_.c_str(), &st) == 0 && st.st_dev == device_ && st.st_ino == inode_) ::unlink(path_.c_str());
  // After the unlink: a sweep that locks the file from now on finds it gone.
  ::close(lock_fd_);
  lock_fd_ = -1;
}

}  // namespace zcore
