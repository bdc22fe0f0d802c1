// The swap manager: round trips through the swap file, its extent allocation
// (placement, reuse of freed extents, coalescing, a full swap space), the
// per-id state machine, and filesystems mounted for a test (root only): one
// that fills up, one that reports no size. The swap file's own life (names,
// the ownership lock, leftovers, directory checks, a file lost under the
// manager) is tested in test_swap_file.cpp.
#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include <gtest/gtest.h>

#include "expect_error.h"
#include "swap_fixture.h"
#include "zcore/status.h"
#include "zcore/swap_manager.h"

namespace fs = std::filesystem;

namespace zcore {
namespace {

using testing_support::error_of;
using testing_support::SwapTest;

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

}  // namespace
}  // namespace zcore
