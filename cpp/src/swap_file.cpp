#include "zcore/swap_file.h"

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

#include "hex.h"
#include "zcore/status.h"

namespace zcore {
namespace {

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
void check(const SwapFileConfig& c) {
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
  // EWOULDBLOCK: a live owner's. Any other failure: left alone too.
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
OwnedFile create_owned_file(const SwapFileConfig& c) {
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
void check_free_space(const SwapFileConfig& c) {
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

}  // namespace

SwapFile::SwapFile(const SwapFileConfig& config) {
  check(config);
  Leftovers leftovers = remove_leftovers(config.directory);
  leftovers_ = std::move(leftovers.paths);
  leftover_bytes_ = leftovers.bytes;
  OwnedFile file = create_owned_file(config);
  path_ = std::move(file.path);
  lock_fd_ = file.fd;
  device_ = file.st.st_dev;
  inode_ = file.st.st_ino;
  try {
    check_free_space(config);
  } catch (...) {
    close();
    throw;
  }
}

SwapFile::~SwapFile() { close(); }

bool SwapFile::intact(std::int64_t* found_inode) const {
  struct stat st {};
  const bool present = ::stat(path_.c_str(), &st) == 0;
  if (present && st.st_dev == device_ && st.st_ino == inode_) return true;
  *found_inode = present ? static_cast<std::int64_t>(st.st_ino) : 0;
  return false;
}

void SwapFile::close() {
  if (lock_fd_ < 0) return;
  std::int64_t found_inode = 0;
  if (intact(&found_inode)) ::unlink(path_.c_str());
  // After the unlink: a sweep that locks the file from now on finds it gone.
  ::close(lock_fd_);
  lock_fd_ = -1;
}

}  // namespace zcore
