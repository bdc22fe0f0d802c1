// The swap manager: round trips through the swap file, its extent allocation
// (placement, reuse of freed extents, coalescing, a full swap space), the
// per-id state machine, the directory checks made before training, and
// sharing a directory (unique files, the ownership lock, removal of leftovers),
// and filesystems mounted for a test (root only): one that fills up, one that
// reports no size.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include <gtest/gtest.h>

#include "expect_error.h"
#include "scratch_dir.h"
#include "zcore/status.h"
#include "zcore/swap_manager.h"

namespace fs = std::filesystem;
using zcore::IoBackend;
using zcore::testing_support::code_of;
using zcore::testing_support::error_of;
using zcore::Error;
using zcore::StatusCode;
using zcore::SwapConfig;
using zcore::SwapManager;
using zcore::SwapState;

namespace {

class SwapTest : public ::testing::Test {
 protected:
  SwapTest() : scratch_("swap-test"), dir_(scratch_.path()) {}

  SwapConfig config(std::int64_t capacity) const {
    SwapConfig c;
    c.directory = dir_.string();
    c.rank = 3;
    c.capacity = capacity;
    c.io.block_size = 64 << 10;
    c.io.queue_depth = 8;
    return c;
  }

  SwapConfig named(const std::string& name) const {
    SwapConfig c = config(1 << 20);
    c.name = name;
    return c;
  }

  // A file of `bytes` bytes in the scratch directory; returns its path.
  std::string write_file(const std::string& name, std::size_t bytes) const {
    const std::string path = (dir_ / name).string();
    std::ofstream f(path, std::ios::binary);
    const std::vector<char> content(bytes, 3);
    f.write(content.data(), static_cast<std::streamsize>(content.size()));
    return path;
  }

  static std::vector<unsigned char> random_bytes(std::size_t n, unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<unsigned char> v(n);
    for (auto& b : v) b = static_cast<unsigned char>(rng());
    return v;
  }

  zcore::testing_support::ScratchDir scratch_;
  fs::path dir_;
};

// A filesystem of `type` mounted at `target` for one test, detached at the
// end; ok() is false (why() says why) where this process may not mount.
class Mounted {
 public:
  Mounted(const fs::path& target, const char* type, const char* options) : target_(target) {
    fs::create_directories(target_);
    if (::geteuid() != 0) {
      why_ = std::string("mounting a ") + type + " filesystem needs root";
    } else if (::mount(type, target_.c_str(), type, 0, options) != 0) {
      why_ = std::string("cannot mount ") + type + " here: " + std::strerror(errno);
    }
  }
  ~Mounted() {
    if (ok()) ::umount2(target_.c_str(), MNT_DETACH);
  }
  Mounted(const Mounted&) = delete;
  Mounted& operator=(const Mounted&) = delete;

  bool ok() const { return why_.empty(); }
  const std::string& why() const { return why_; }

 private:
  fs::path target_;
  std::string why_;
};

// Writes zeros to `path` until its filesystem is full.
void fill_up(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  const std::vector<char> zeros(4096, 0);
  while (::write(fd, zeros.data(), zeros.size()) > 0) {
  }
  const int err = errno;
  ::close(fd);
  ASSERT_EQ(err, ENOSPC);
}

TEST_F(SwapTest, RoundTripsSeveralIdsInFlightTogether) {
  SwapManager swap(config(16 << 20));
  EXPECT_NE(swap.path().find("rank3"), std::string::npos);
  std::vector<std::vector<unsigned char>> data;
  const std::vector<std::size_t> sizes = {1, 4095, 4096, 100000, 1 << 20, 3 << 20};
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    data.push_back(random_bytes(sizes[i], static_cast<unsigned>(i)));
    swap.swap_out(static_cast<zcore::SwapId>(i), data[i].data(), static_cast<std::int64_t>(sizes[i]));
  }
  swap.wait_all();
  std::vector<std::vector<unsigned char>> back;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(swap.state(static_cast<zcore::SwapId>(i)), SwapState::kOnDisk);
    back.emplace_back(sizes[i]);
    swap.swap_in(static_cast<zcore::SwapId>(i), back[i].data(), static_cast<std::int64_t>(sizes[i]));
    EXPECT_EQ(swap.state(static_cast<zcore::SwapId>(i)), SwapState::kReading);
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    swap.wait(static_cast<zcore::SwapId>(i));
    EXPECT_EQ(back[i], data[i]) << "id " << i;
  }
  EXPECT_EQ(swap.stats().bytes_swapped_in, swap.stats().bytes_swapped_out);
}

TEST_F(SwapTest, ExtentsAreAlignedDisjointAndFreedOnesAreReused) {
  SwapManager swap(config(1 << 20));
  std::vector<unsigned char> buf(300000, 1);
  for (zcore::SwapId id = 0; id < 3; ++id) swap.swap_out(id, buf.data(), 100000);
  swap.wait_all();
  std::vector<zcore::SwapExtent> e;
  for (zcore::SwapId id = 0; id < 3; ++id) e.push_back(swap.extent(id));
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(e[i].offset % zcore::kIoAlignment, 0u);
    EXPECT_EQ(e[i].bytes, 100000u);
    for (std::size_t j = i + 1; j < 3; ++j) {
      EXPECT_TRUE(e[i].offset + 102400 <= e[j].offset || e[j].offset + 102400 <= e[i].offset);
    }
  }
  EXPECT_EQ(swap.stats().used, 3u * 102400);

  swap.release(1);
  swap.swap_out(7, buf.data(), 90000);  // fits the freed extent of id 1
  swap.wait(7);
  EXPECT_EQ(swap.extent(7).offset, e[1].offset);

  // Freed neighbours coalesce into one extent large enough for both.
  swap.release(7);
  swap.release(0);
  const std::uint64_t low = std::min(e[0].offset, e[1].offset);
  swap.swap_out(8, buf.data(), 200000);
  swap.wait(8);
  EXPECT_EQ(swap.extent(8).offset, low);
}

TEST_F(SwapTest, OverwritesInPlaceOrMovesWhenTheIdGrows) {
  SwapManager swap(config(1 << 20));
  auto a = random_bytes(50000, 1), b = random_bytes(50000, 2), c = random_bytes(200000, 3);
  swap.swap_out(1, a.data(), 50000);
  swap.wait(1);
  const auto first = swap.extent(1).offset;
  swap.swap_out(1, b.data(), 50000);
  swap.wait(1);
  EXPECT_EQ(swap.extent(1).offset, first);
  swap.swap_out(2, a.data(), 50000);  // sits right after id 1
  swap.swap_out(1, c.data(), 200000);
  swap.wait_all();
  EXPECT_NE(swap.extent(1).offset, first);
  std::vector<unsigned char> back(200000);
  swap.swap_in(1, back.data(), 200000);
  swap.wait(1);
  EXPECT_EQ(back, c);
}

TEST_F(SwapTest, FullSwapSpaceIsNoSpaceAndReleasingMakesRoom) {
  SwapManager swap(config(256 << 10));
  std::vector<unsigned char> buf(200 << 10, 5);
  swap.swap_out(1, buf.data(), 200 << 10);
  try {
    swap.swap_out(2, buf.data(), 100 << 10);
    FAIL() << "expected kNoSpace";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kNoSpace);
  }
  swap.wait(1);
  swap.release(1);
  swap.swap_out(2, buf.data(), 100 << 10);
  swap.wait(2);
}

// The swap file grows as extents are first written (it is not preallocated):
// a disk that filled up since the constructor's check fails that swap-out with
// kNoSpace naming the file, the bytes needed and the bytes free, drops the id,
// and leaves the others readable. For both backends.
TEST_F(SwapTest, SwapOutOnAFullFilesystemIsNoSpaceNamingNeededAndFreeBytes) {
  for (const IoBackend backend : {IoBackend::kAuto, IoBackend::kThreadPool}) {
    const fs::path small = dir_ / ("small-" + std::to_string(static_cast<int>(backend)));
    Mounted mounted(small, "tmpfs", "size=1m");
    if (!mounted.ok()) GTEST_SKIP() << mounted.why();
    SwapConfig c = config(512 << 10);
    c.directory = small.string();
    c.io.backend = backend;
    SwapManager swap(c);
    const auto kept = random_bytes(64 << 10, 1);
    swap.swap_out(0, kept.data(), 64 << 10);
    swap.wait(0);
    ASSERT_NO_FATAL_FAILURE(fill_up((small / "filler").string()));

    const std::vector<unsigned char> big(256 << 10, 7);
    swap.swap_out(1, big.data(), 256 << 10);
    const Error e = error_of([&] { swap.wait(1); });
    ASSERT_EQ(e.code(), StatusCode::kNoSpace) << e.what();
    std::map<std::string, zcore::ErrorDetail> details(e.details().begin(), e.details().end());
    EXPECT_EQ(std::get<std::string>(details.at("path")), swap.path());
    EXPECT_EQ(std::get<std::int64_t>(details.at("errno")), ENOSPC);
    EXPECT_EQ(std::get<std::int64_t>(details.at("required")), 256 << 10);
    const std::int64_t available = std::get<std::int64_t>(details.at("available"));
    EXPECT_GE(available, 0);
    EXPECT_LT(available, 256 << 10);
    const std::string message = e.what();
    EXPECT_NE(message.find(swap.path()), std::string::npos) << message;
    EXPECT_NE(message.find("needs 262144 bytes"), std::string::npos) << message;
    EXPECT_NE(message.find(std::to_string(available) + " bytes free"), std::string::npos) << message;

    EXPECT_FALSE(swap.contains(1));
    std::vector<unsigned char> back(64 << 10);
    swap.swap_in(0, back.data(), 64 << 10);
    swap.wait(0);
    EXPECT_EQ(back, kept);
  }
}

// ramfs reports no size (statvfs f_blocks 0, so no free blocks either) and
// refuses O_DIRECT: the constructor does not take it for full, and the swap
// file's I/O goes through the page cache.
TEST_F(SwapTest, AcceptsAFilesystemThatReportsNoSize) {
  Mounted mounted(dir_ / "ramfs", "ramfs", "mode=755");
  if (!mounted.ok()) GTEST_SKIP() << mounted.why();
  SwapConfig c = config(1 << 20);
  c.directory = (dir_ / "ramfs").string();
  SwapManager swap(c);
  EXPECT_EQ(swap.engine().backend(), IoBackend::kThreadPool);
  EXPECT_FALSE(swap.engine().backend_reason().empty());
  const auto data = random_bytes(100000, 2);
  swap.swap_out(1, data.data(), 100000);
  swap.wait(1);
  std::vector<unsigned char> back(100000);
  swap.swap_in(1, back.data(), 100000);
  swap.wait(1);
  EXPECT_EQ(back, data);
}

TEST_F(SwapTest, StateMachineRefusesOverlappingUse) {
  SwapManager swap(config(1 << 20));
  std::vector<unsigned char> buf(8192, 1);
  EXPECT_THROW(swap.swap_in(9, buf.data(), 8192), Error);  // never swapped out
  swap.swap_out(1, buf.data(), 8192);
  EXPECT_THROW(swap.swap_out(1, buf.data(), 8192), Error);  // write in flight
  EXPECT_THROW(swap.release(1), Error);
  swap.wait(1);
  EXPECT_TRUE(swap.poll(1));
  EXPECT_THROW(swap.swap_in(1, buf.data(), 4096), Error);  // wrong size
}

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

// Note "swap file ownership" (zcore/swap_manager.h): every rank of every job
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
