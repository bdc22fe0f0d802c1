// The swap file's life (zcore/swap_file.h), through the swap manager that
// owns it and alone: closing removes it; a file deleted, replaced or changed
// under the manager is never read back as the bytes swapped out; sharing a
// directory (unique names, the ownership lock, removal of leftovers); and the
// directory checks made before training.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "expect_error.h"
#include "swap_fixture.h"
#include "zcore/status.h"
#include "zcore/swap_file.h"
#include "zcore/swap_manager.h"

namespace fs = std::filesystem;

namespace zcore {
namespace {

using testing_support::code_of;
using testing_support::error_of;
using testing_support::SwapTest;

TEST_F(SwapTest, CloseRemovesTheSwapFile) {
  std::string path;
  {
    // Declared first, destroyed last: the swap-out reads it until the manager's destructor waits.
    std::vector<unsigned char> buf(8192, 1);
    SwapManager swap(config(1 << 20));
    path = swap.path();
    swap.swap_out(1, buf.data(), 8192);
    EXPECT_TRUE(fs::exists(path));
  }
  EXPECT_FALSE(fs::exists(path));
  SwapManager swap(config(1 << 20));
  swap.close();
  EXPECT_FALSE(fs::exists(swap.path()));
  EXPECT_THROW(swap.ids(), Error);
}

// A SwapFile without a manager: it sweeps, names and locks its file, knows
// while the path still names that file, and closing removes only that file.
TEST_F(SwapTest, SwapFileAloneSweepsLocksAndRemovesOnlyItself) {
  const std::string leftover = write_file("zcore-swap-rank0-otherhost-4242-00000000deadbeef.swp", 100);
  SwapFileConfig c;
  c.directory = dir_.string();
  c.rank = 2;
  c.name = "alone";
  c.capacity = 1 << 20;
  SwapFile file(c);
  EXPECT_EQ(file.leftovers_removed(), std::vector<std::string>{leftover});
  EXPECT_EQ(file.leftover_bytes_removed(), 100u);
  EXPECT_NE(file.path().find("zcore-swap-alone-rank2-"), std::string::npos) << file.path();
  EXPECT_EQ(fs::file_size(file.path()), 0u);
  std::int64_t found = -1;
  EXPECT_TRUE(file.intact(&found));
  const int fd = ::open(file.path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::flock(fd, LOCK_EX | LOCK_NB), -1);  // held by the SwapFile
  EXPECT_EQ(errno, EWOULDBLOCK);

  std::ofstream(file.path() + ".other").put('x');
  fs::rename(file.path() + ".other", file.path());
  EXPECT_FALSE(file.intact(&found));
  EXPECT_NE(found, 0);
  EXPECT_NE(found, static_cast<std::int64_t>(file.inode()));
  file.close();
  EXPECT_TRUE(fs::exists(file.path()));  // another's file, left in place
  EXPECT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);  // released
  ::close(fd);
  fs::remove(file.path());
  EXPECT_FALSE(file.intact(&found));
  EXPECT_EQ(found, 0);
}

// The file a tmp cleaner deletes, or another job replaces, must never hand
// back zeros or foreign bytes: each backend, each way of losing the file.
class SwapFileLostTest : public SwapTest, public ::testing::WithParamInterface<IoBackend> {
 protected:
  // A manager on the backend under test holding id 1 (`bytes` random bytes) on disk.
  std::unique_ptr<SwapManager> holding_one_id(std::int64_t capacity, std::int64_t bytes) {
    SwapConfig c = config(capacity);
    c.io.backend = GetParam();
    auto swap = std::make_unique<SwapManager>(c);
    data_ = random_bytes(static_cast<std::size_t>(bytes), 1);
    swap->swap_out(1, data_.data(), bytes);
    swap->wait(1);
    return swap;
  }
  std::vector<unsigned char> data_;
};

TEST_P(SwapFileLostTest, DeletedFileIsLostAndNotRecreated) {
  auto owner = holding_one_id(1 << 20, 10000);
  SwapManager& swap = *owner;
  ASSERT_EQ(::unlink(swap.path().c_str()), 0);
  const auto b = random_bytes(10000, 2);
  EXPECT_EQ(code_of([&] { swap.swap_out(2, b.data(), 10000); }), StatusCode::kSwapFileLost);
  EXPECT_FALSE(fs::exists(swap.path()));  // not recreated by the write
  std::vector<unsigned char> back(10000);
  const zcore::Error e = error_of([&] { swap.swap_in(1, back.data(), 10000); });
  EXPECT_EQ(e.code(), StatusCode::kSwapFileLost);
  EXPECT_NE(std::string(e.what()).find("was deleted"), std::string::npos) << e.what();
  EXPECT_EQ(code_of([&] { swap.release(1); }), StatusCode::kSwapFileLost);
  swap.close();
}

TEST_P(SwapFileLostTest, ReplacedFileIsLostAndLeftInPlace) {
  auto owner = holding_one_id(1 << 20, 8192);
  SwapManager& swap = *owner;
  const std::string other = swap.path() + ".other";
  {
    std::ofstream f(other, std::ios::binary);
    const std::vector<char> same_size(fs::file_size(swap.path()), 7);
    f.write(same_size.data(), static_cast<std::streamsize>(same_size.size()));
  }
  fs::rename(other, swap.path());
  std::vector<unsigned char> back(8192);
  const zcore::Error e = error_of([&] { swap.swap_in(1, back.data(), 8192); });
  EXPECT_EQ(e.code(), StatusCode::kSwapFileLost);
  EXPECT_NE(std::string(e.what()).find("replaced by another file"), std::string::npos) << e.what();
  swap.close();
  EXPECT_TRUE(fs::exists(swap.path()));  // close() removes only its own file
}

TEST_P(SwapFileLostTest, FileDeletedWhileASwapInIsPendingFailsItsWait) {
  auto owner = holding_one_id(4 << 20, 3 << 20);
  SwapManager& swap = *owner;
  std::vector<unsigned char> back(3 << 20);
  swap.swap_in(1, back.data(), 3 << 20);
  ASSERT_EQ(::unlink(swap.path().c_str()), 0);
  // The open descriptor may still finish the read; either way wait() reports the loss.
  EXPECT_EQ(code_of([&] { swap.wait(1); }), StatusCode::kSwapFileLost);
  EXPECT_EQ(code_of([&] { swap.contains(1); }), StatusCode::kSwapFileLost);
}

// Bytes changed in place (same file, same inode): another writer, a bug that
// overlapped extents, a disk returning other data. The checksum catches it;
// the id stays on disk and a new swap-out of it round-trips again.
TEST_P(SwapFileLostTest, BytesChangedInPlaceAreCorruptedNamingTheExtent) {
  auto owner = holding_one_id(1 << 20, 100000);
  SwapManager& swap = *owner;
  const zcore::SwapExtent where = swap.extent(1);
  {
    const int fd = ::open(swap.path().c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    const unsigned char flipped = static_cast<unsigned char>(data_[77777] ^ 0x10);
    ASSERT_EQ(::pwrite(fd, &flipped, 1, static_cast<off_t>(where.offset + 77777)), 1);
    ::fsync(fd);
    ::close(fd);
  }
  std::vector<unsigned char> back(100000);
  swap.swap_in(1, back.data(), 100000);
  const zcore::Error e = error_of([&] { swap.wait(1); });
  EXPECT_EQ(e.code(), StatusCode::kSwapCorrupted);
  const std::string message = e.what();
  EXPECT_NE(message.find("id 1 "), std::string::npos) << message;
  EXPECT_NE(message.find("offset " + std::to_string(where.offset)), std::string::npos) << message;
  EXPECT_NE(message.find(swap.path()), std::string::npos) << message;
  EXPECT_EQ(swap.state(1), SwapState::kOnDisk);

  swap.swap_out(1, data_.data(), 100000);
  swap.wait(1);
  swap.swap_in(1, back.data(), 100000);
  swap.wait(1);
  EXPECT_EQ(back, data_);
}

INSTANTIATE_TEST_SUITE_P(Backends, SwapFileLostTest,
                         ::testing::Values(IoBackend::kAuto, IoBackend::kThreadPool),
                         [](const auto& info) { return std::string(zcore::io_backend_name(info.param)); });

// Note "swap file ownership" (zcore/swap_file.h): every rank of every job
// may share one directory; each manager has its own locked file, and removes
// only the files whose lock nobody holds.

TEST_F(SwapTest, ManagersOfOneRankShareADirectoryButNeverAFile) {
  const std::regex format("zcore-swap-params-rank3-[A-Za-z0-9_-]{1,32}-" + std::to_string(::getpid()) +
                          "-[0-9a-f]{16}\\.swp");
  std::vector<std::unique_ptr<SwapManager>> managers;
  for (const char* name : {"params", "optimizer", "params", ""}) {
    managers.push_back(std::make_unique<SwapManager>(named(name)));
  }
  EXPECT_TRUE(std::regex_match(fs::path(managers[0]->path()).filename().string(), format))
      << managers[0]->path();
  EXPECT_NE(managers[1]->path().find("zcore-swap-optimizer-rank3-"), std::string::npos);
  EXPECT_NE(managers[3]->path().find("zcore-swap-rank3-"), std::string::npos);
  std::set<std::string> paths;
  for (const auto& m : managers) paths.insert(m->path());
  EXPECT_EQ(paths.size(), managers.size());
  // Each file is live (locked), so no later constructor took one for a leftover.
  std::vector<std::vector<unsigned char>> data;
  for (std::size_t i = 0; i < managers.size(); ++i) {
    EXPECT_TRUE(managers[i]->leftovers_removed().empty());
    data.push_back(random_bytes(10000, static_cast<unsigned>(i)));
    managers[i]->swap_out(1, data[i].data(), 10000);
  }
  for (std::size_t i = 0; i < managers.size(); ++i) {
    managers[i]->wait(1);
    std::vector<unsigned char> back(10000);
    managers[i]->swap_in(1, back.data(), 10000);
    managers[i]->wait(1);
    EXPECT_EQ(back, data[i]) << managers[i]->path();
  }
}

TEST_F(SwapTest, RefusesANameThatIsNotAFileNamePart) {
  const std::vector<std::string> refused = {"a-b", "x/y", "..", "with space", "\xc3\xbc", std::string(65, 'a')};
  for (const std::string& bad : refused) {
    const Error e = error_of([&] { SwapManager swap(named(bad)); });
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(std::string(e.what()).find("swap name '" + bad + "'"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_empty(dir_));
  SwapManager ok(named("Optimizer_2"));
  EXPECT_NE(ok.path().find("zcore-swap-Optimizer_2-rank3-"), std::string::npos);
}

TEST_F(SwapTest, CloseRemovesTheFileAndReleasesItsLock) {
  SwapManager swap(config(1 << 20));
  const int fd = ::open(swap.path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::flock(fd, LOCK_EX | LOCK_NB), -1);  // held by the manager
  EXPECT_EQ(errno, EWOULDBLOCK);
  swap.close();
  EXPECT_FALSE(fs::exists(swap.path()));
  EXPECT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  ::close(fd);
}

TEST_F(SwapTest, UnlockedSwapFilesAreLeftoversRemovedAndReported) {
  const std::string a = write_file("zcore-swap-rank0-otherhost-4242-00000000deadbeef.swp", 5000);
  const std::string b = write_file("zcore-swap-rank1-pid999.swp", 0);  // the earlier naming
  SwapManager swap(config(1 << 20));
  EXPECT_EQ(std::set<std::string>(swap.leftovers_removed().begin(), swap.leftovers_removed().end()),
            (std::set<std::string>{a, b}));
  EXPECT_EQ(swap.stats().leftover_bytes_removed, 5000u);
  EXPECT_FALSE(fs::exists(a));
  EXPECT_FALSE(fs::exists(b));
  SwapManager next(config(1 << 20));  // the live file of `swap` is no leftover
  EXPECT_TRUE(next.leftovers_removed().empty());
  EXPECT_EQ(next.stats().leftover_bytes_removed, 0u);
  EXPECT_TRUE(fs::exists(swap.path()));
}

TEST_F(SwapTest, SwapFileWhoseLockIsHeldIsLeftAlone) {
  const std::string held = write_file("zcore-swap-optimizer-rank0-otherhost-7-0123456789abcdef.swp", 4096);
  const int fd = ::open(held.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);  // as a live manager of another job holds it
  {
    SwapManager swap(config(1 << 20));
    EXPECT_TRUE(swap.leftovers_removed().empty());
    EXPECT_TRUE(fs::exists(held));
  }
  ::close(fd);  // its owner died
  SwapManager swap(config(1 << 20));
  EXPECT_EQ(swap.leftovers_removed(), std::vector<std::string>{held});
  EXPECT_EQ(swap.stats().leftover_bytes_removed, 4096u);
}

TEST_F(SwapTest, AnUnlockedFileOfALiveProcessOfThisHostIsNoLeftover) {
  // What another rank's constructor sees between creating its file and locking it.
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof(host) - 1), 0);
  std::string tag;
  for (const char* p = host; *p != '\0' && tag.size() < 32; ++p) {
    tag += std::isalnum(static_cast<unsigned char>(*p)) || *p == '_' || *p == '-' ? *p : '_';
  }
  const std::string mine = write_file(
      "zcore-swap-optimizer-rank1-" + tag + "-" + std::to_string(::getpid()) + "-0123456789abcdef.swp", 0);
  const std::string elsewhere = write_file(
      "zcore-swap-optimizer-rank1-not" + tag + "-" + std::to_string(::getpid()) + "-0123456789abcdef.swp", 10);
  SwapManager swap(config(1 << 20));
  EXPECT_TRUE(fs::exists(mine));
  EXPECT_EQ(swap.leftovers_removed(), std::vector<std::string>{elsewhere});
}

TEST_F(SwapTest, OnlyRegularFilesNamedLikeSwapFilesAreSwept) {
  const std::vector<std::string> others = {
      write_file("zcore-swap-rank0.swp.bak", 10), write_file("other-rank0.swp", 10),
      write_file("notes.txt", 10), write_file("zcore-swap-rank0-h-1-0.swpx", 10)};
  const std::string target = write_file("target.dat", 10);
  const fs::path link = dir_ / "zcore-swap-link.swp";
  fs::create_symlink(target, link);
  const fs::path dangling = dir_ / "zcore-swap-dangling.swp";
  fs::create_symlink(dir_ / "absent", dangling);
  const fs::path directory = dir_ / "zcore-swap-dir.swp";
  fs::create_directory(directory);
  const std::string inside = write_file("zcore-swap-dir.swp/zcore-swap-rank0-h-1-0.swp", 10);
  SwapManager swap(config(1 << 20));
  EXPECT_TRUE(swap.leftovers_removed().empty());
  for (const std::string& path : others) EXPECT_TRUE(fs::exists(path)) << path;
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_TRUE(fs::is_symlink(dangling));
  EXPECT_EQ(fs::file_size(target), 10u);
  EXPECT_TRUE(fs::is_directory(directory));
  EXPECT_TRUE(fs::exists(inside));  // only the directory given is swept
}

// Ranks starting together: each constructor sweeps while others create and
// lock their files. A file swept between its creation and its lock makes its
// creator take a new name, so every manager ends up with a file of its own.
TEST_F(SwapTest, ConstructorsRacingInOneDirectoryEachKeepTheirFile) {
  std::vector<std::thread> ranks;
  std::vector<int> failures(4, 0);
  for (int r = 0; r < 4; ++r) {
    ranks.emplace_back([&, r] {
      const auto data = random_bytes(4096, static_cast<unsigned>(r));
      std::vector<unsigned char> back(4096);
      for (int i = 0; i < 25; ++i) {
        try {
          SwapConfig c = config(1 << 20);
          c.rank = r;
          c.io.backend = IoBackend::kThreadPool;
          SwapManager swap(c);
          swap.swap_out(1, data.data(), 4096);
          swap.wait(1);
          swap.swap_in(1, back.data(), 4096);
          swap.wait(1);
          if (back != data) ++failures[static_cast<std::size_t>(r)];
        } catch (const Error&) {
          ++failures[static_cast<std::size_t>(r)];
        }
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(failures, std::vector<int>(4, 0));
  EXPECT_TRUE(fs::is_empty(dir_));
}

// The real case: a process holding a manager dies by SIGKILL (no destructor,
// no close()); its lock dies with it. While it lives, its file is left alone.
TEST_F(SwapTest, SwapFileOfAKilledProcessIsRemovedByTheNextManager) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(pipe_fds[0]);
    try {
      SwapConfig c = named("params");
      c.rank = 0;
      SwapManager swap(c);
      const auto data = random_bytes(50000, 9);
      swap.swap_out(1, data.data(), 50000);
      swap.wait(1);
      const std::string line = swap.path() + "\n";
      if (::write(pipe_fds[1], line.data(), line.size()) != static_cast<ssize_t>(line.size())) ::_exit(2);
      for (;;) ::pause();
    } catch (...) {
      ::_exit(1);
    }
  }
  ::close(pipe_fds[1]);
  std::string path;
  char ch = 0;
  while (::read(pipe_fds[0], &ch, 1) == 1 && ch != '\n') path += ch;
  ::close(pipe_fds[0]);
  ASSERT_FALSE(path.empty()) << "the child could not make its swap manager";
  const auto bytes = fs::file_size(path);
  EXPECT_GE(bytes, 50000u);
  {
    SwapManager swap(named("params"));
    EXPECT_TRUE(swap.leftovers_removed().empty());
    EXPECT_TRUE(fs::exists(path));
  }
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  ASSERT_TRUE(fs::exists(path));  // nothing ran at its death
  SwapManager swap(named("params"));
  EXPECT_EQ(swap.leftovers_removed(), std::vector<std::string>{path});
  EXPECT_EQ(swap.stats().leftover_bytes_removed, bytes);
  EXPECT_FALSE(fs::exists(path));
}

TEST_F(SwapTest, RefusesAMissingDirectoryOrTooLittleFreeSpace) {
  SwapConfig missing = config(1 << 20);
  missing.directory = (dir_ / "absent").string();
  try {
    SwapManager swap(missing);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kIoError);
  }
  try {
    SwapManager swap(config(std::int64_t{1} << 60));  // an exabyte
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kNoSpace);
    EXPECT_NE(std::string(e.what()).find("free"), std::string::npos);
  }
  EXPECT_TRUE(fs::is_empty(dir_));  // nothing left behind by the refusals
}

TEST_F(SwapTest, RefusesADirectoryWithoutWritePermission) {
  if (::geteuid() == 0) {
    GTEST_SKIP() << "root ignores permission bits; tests/python/test_swap.py covers this "
                    "with a read-only mount";
  }
  fs::permissions(dir_, fs::perms::owner_read | fs::perms::owner_exec);
  try {
    SwapManager swap(config(1 << 20));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kIoError);
  }
  fs::permissions(dir_, fs::perms::owner_all);
}

}  // namespace
}  // namespace zcore
