// A swap file's lifetime: its name, its creation under an ownership lock, the
// sweep of the files that killed processes left behind, the checks of its
// directory, and its removal. The swap manager (swap_manager.h) owns one and
// schedules the I/O into it.
//
// Sharing a directory (note "swap file ownership"). Every rank of every job
// may be given the same directory, on one host or on several over a shared
// filesystem, and one process may hold several swap files there:
//   - The file is zcore-swap-<name>-rank<R>-<host>-<pid>-<random>.swp, created
//     with O_EXCL (a new random part on a collision), so no two owners ever
//     share a file. `name` (optional) says what the file holds.
//   - The owner holds flock(LOCK_EX) on the file from its creation until
//     close(); the kernel drops it when the process dies, however it dies
//     (over NFS, a host that died releases it once its lease expires).
//   - The constructor first removes leftovers: files named zcore-swap-*.swp
//     that nobody holds the lock of (their owner's process died). A file
//     whose lock is held is a live owner's and is left alone, as are
//     symlinks, directories and every other name, and files named by a live
//     process of this host (at most one not locked yet, below).
//     leftovers_removed() lists what was removed; leftover_bytes_removed()
//     counts the bytes.
//   - A file is created, then locked, then checked to be still there: a
//     constructor sweeping in between (it saw an unlocked file) makes this one
//     try a new name rather than use a removed file.
// Locks across hosts need a filesystem that shares them (NFS with its lock
// manager, Lustre mounted with -o flock): where locks are host-local,
// give each host its own directory. A filesystem that refuses flock (ENOLCK,
// ENOSYS, EOPNOTSUPP) is kIoError at construction: without the lock, another
// owner's sweep could take this live file for a leftover.
//
// The constructor checks the directory before training starts: it must exist,
// accept a new file (kIoError naming the path and errno otherwise: EACCES,
// EROFS, ...), and its filesystem must have `capacity` bytes free once the
// leftovers are removed (kNoSpace with `required` and `available`; not checked
// where the filesystem reports no size, like ramfs). The file is created empty
// and not preallocated. A constructor that throws leaves no file behind.
//
// A tmp cleaner may delete the file and another job may put a file of its
// own at the path: intact() tells whether the path still names the file
// created (device and inode), and close() removes only that file.
//
// Not thread-safe: its owner serialises the calls (the swap manager does so
// under its lock).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace zcore {

struct SwapFileConfig {
  std::string directory;      // must exist and be writable; may be shared (see the note above)
  int rank = 0;               // named in the file name, for people looking at the directory
  std::string name;           // purpose tag in the file name ("params", "optimizer"):
                              // [A-Za-z0-9_]{0,64}, else kInvalidArgument
  std::int64_t capacity = 0;  // bytes the owner plans to write: > 0, and free in the directory
};

class SwapFile {
 public:
  // Checks `config`, removes the leftovers, creates and locks the file, then
  // checks the free space.
  explicit SwapFile(const SwapFileConfig& config);
  ~SwapFile();  // close()
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;

  const std::string& path() const { return path_; }
  // Leftover swap files of dead processes that the constructor removed, and their sizes' sum.
  const std::vector<std::string>& leftovers_removed() const { return leftovers_; }
  std::uint64_t leftover_bytes_removed() const { return leftover_bytes_; }
  ino_t inode() const { return inode_; }  // of the file created

  // Whether path() still names the file created (same device and inode; the
  // open descriptor keeps its inode number from being reused meanwhile).
  // When it does not, *found_inode is the inode at path() now, 0 when
  // nothing is there.
  bool intact(std::int64_t* found_inode) const;

  // Removes the file when path() still names it (a file that replaced it is
  // someone else's), then releases the lock. Later calls do nothing.
  void close();

 private:
  std::vector<std::string> leftovers_;
  std::uint64_t leftover_bytes_ = 0;
  std::string path_;
  int lock_fd_ = -1;  // the file, open with flock(LOCK_EX) held until close()
  dev_t device_ = 0;  // identity of the file created
  ino_t inode_ = 0;
};

}  // namespace zcore
