// The I/O engine against an independent reference: bytes are written with the
// engine and checked with plain pread (and the other way round), for both
// backends, aligned and unaligned buffers, offsets and sizes.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <limits>
#include <random>
#include <thread>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "expect_error.h"
#include "scratch_dir.h"
#include "zcore/aio_engine.h"
#include "zcore/status.h"

namespace fs = std::filesystem;
using zcore::AioConfig;
using zcore::AioEngine;
using zcore::Error;
using zcore::IoBackend;
using zcore::IoOp;
using zcore::StatusCode;

namespace {

class TempDir : public zcore::testing_support::ScratchDir {
 public:
  TempDir() : ScratchDir("aio-test") {}
};

std::vector<unsigned char> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

std::vector<unsigned char> read_file(const std::string& path) {
  std::vector<unsigned char> v(static_cast<std::size_t>(fs::file_size(path)));
  const int fd = ::open(path.c_str(), O_RDONLY);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::pread(fd, v.data(), v.size(), 0), static_cast<ssize_t>(v.size()));
  ::close(fd);
  return v;
}

void write_file(const std::string& path, const std::vector<unsigned char>& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

// Page-aligned storage with `shift` extra bytes in front, to test buffers
// that are aligned and ones that are not.
class Buffer {
 public:
  Buffer(std::size_t bytes, std::size_t shift) : storage_(bytes + shift + 8192), shift_(shift) {
    const auto base = reinterpret_cast<std::uintptr_t>(storage_.data());
    aligned_ = (4096 - base % 4096) % 4096;
  }
  unsigned char* data() { return storage_.data() + aligned_ + shift_; }

 private:
  std::vector<unsigned char> storage_;
  std::size_t shift_;
  std::size_t aligned_ = 0;
};

AioConfig config_for(IoBackend backend, std::int64_t block = 64 << 10) {
  AioConfig c;
  c.backend = backend;
  c.block_size = block;
  c.queue_depth = 8;
  c.threads = 2;
  return c;
}

class AioEngineTest : public ::testing::TestWithParam<IoBackend> {
 protected:
  std::unique_ptr<AioEngine> make(std::int64_t block = 64 << 10) {
    if (GetParam() == IoBackend::kLibaio && !zcore::libaio_compiled()) return nullptr;
    return AioEngine::create(config_for(GetParam(), block));
  }
  TempDir tmp_;
};

#define MAKE_ENGINE(name, ...)                                             \
  auto name = make(__VA_ARGS__);                                           \
  if (!name) GTEST_SKIP() << "zcore was built without libaio (THREADPOOL)"

TEST_P(AioEngineTest, ReportsTheBackendInUse) {
  MAKE_ENGINE(engine);
  EXPECT_EQ(engine->backend(), GetParam());
  EXPECT_FALSE(engine->backend_reason().empty());
}

TEST_P(AioEngineTest, RoundTripsOddSizesOffsetsAndBuffers) {
  MAKE_ENGINE(engine);
  const std::int64_t block = engine->config().block_size;
  const std::vector<std::int64_t> sizes = {1, 4095, 4096, 4097, block - 1, block + 1, 3 * block + 777};
  const std::vector<std::int64_t> offsets = {0, 1, 4095, 4096, 5 * 4096 + 13};
  unsigned seed = 1;
  for (std::int64_t size : sizes) {
    for (std::int64_t offset : offsets) {
      for (std::size_t shift : {std::size_t{0}, std::size_t{1}, static_cast<std::size_t>(offset % 4096)}) {
        const std::string path = tmp_.file("rt");
        // Existing bytes around the range must survive (no sector clobbering).
        std::vector<unsigned char> expect = random_bytes(offset + size + 5000, seed++);
        write_file(path, expect);
        const auto data = random_bytes(static_cast<std::size_t>(size), seed++);
        Buffer out(data.size(), shift);
        std::memcpy(out.data(), data.data(), data.size());
        engine->wait(engine->submit({IoOp::kWrite, out.data(), size, path, offset}));
        std::memcpy(expect.data() + offset, data.data(), data.size());
        ASSERT_EQ(read_file(path), expect) << "size " << size << " offset " << offset << " shift " << shift;

        Buffer in(data.size(), shift);
        engine->wait(engine->submit({IoOp::kRead, in.data(), size, path, offset}));
        ASSERT_EQ(0, std::memcmp(in.data(), data.data(), data.size()))
            << "size " << size << " offset " << offset << " shift " << shift;
      }
    }
  }
}

TEST_P(AioEngineTest, WriteExtendsTheFileExactlyToItsEnd) {
  MAKE_ENGINE(engine);
  const std::string path = tmp_.file("tail");
  const auto data = random_bytes(10000, 7);
  Buffer b(data.size(), 0);
  std::memcpy(b.data(), data.data(), data.size());
  engine->wait(engine->submit({IoOp::kWrite, b.data(), 10000, path, 123}));
  EXPECT_EQ(fs::file_size(path), 10123u);
  const auto on_disk = read_file(path);
  EXPECT_TRUE(std::equal(data.begin(), data.end(), on_disk.begin() + 123));
}

TEST_P(AioEngineTest, ManyConcurrentRequestsSharingSectors) {
  MAKE_ENGINE(engine);
  const std::string path = tmp_.file("many");
  std::mt19937 rng(42);
  // Adjacent ranges with random sizes: neighbours share partial sectors, so a
  // read-modify-write of a sector would lose bytes under concurrency.
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  std::int64_t at = 0;
  for (int i = 0; i < 200; ++i) {
    const std::int64_t n = 1 + static_cast<std::int64_t>(rng() % (3 * 65536));
    ranges.push_back({at, n});
    at += n;
  }
  const auto data = random_bytes(static_cast<std::size_t>(at), 9);
  Buffer src(data.size(), 0);
  std::memcpy(src.data(), data.data(), data.size());
  std::vector<zcore::IoHandle> handles;
  for (const auto& [off, n] : ranges) {
    handles.push_back(engine->submit({IoOp::kWrite, src.data() + off, n, path, off}));
  }
  EXPECT_EQ(engine->pending(), 200);
  engine->wait_all();
  EXPECT_EQ(engine->pending(), 0);
  EXPECT_EQ(read_file(path), data);

  Buffer dst(data.size(), 0);
  for (const auto& [off, n] : ranges) {
    handles.push_back(engine->submit({IoOp::kRead, dst.data() + off, n, path, off}));
  }
  engine->wait_all();
  EXPECT_EQ(0, std::memcmp(dst.data(), data.data(), data.size()));
}

TEST_P(AioEngineTest, PollTurnsTrueAndHandlesAreForgottenAfterWait) {
  MAKE_ENGINE(engine);
  const std::string path = tmp_.file("poll");
  Buffer b(1 << 20, 0);
  const auto h = engine->submit({IoOp::kWrite, b.data(), 1 << 20, path, 0});
  while (!engine->poll(h)) std::this_thread::yield();
  engine->wait(h);
  try {
    engine->poll(h);
    FAIL() << "poll of a waited handle must throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidHandle);
  }
  EXPECT_THROW(engine->wait(12345), Error);
}

TEST_P(AioEngineTest, ReadPastTheEndIsFileTooSmall) {
  MAKE_ENGINE(engine);
  const std::string path = tmp_.file("small");
  write_file(path, random_bytes(1000, 3));
  Buffer b(4096, 0);
  try {
    engine->submit({IoOp::kRead, b.data(), 1001, path, 0});
    FAIL() << "expected kFileTooSmall";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kFileTooSmall);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos);
  }
  engine->wait(engine->submit({IoOp::kRead, b.data(), 1000, path, 0}));
}

TEST_P(AioEngineTest, MissingFileIsAnIoErrorWithErrno) {
  MAKE_ENGINE(engine);
  Buffer b(4096, 0);
  try {
    engine->submit({IoOp::kRead, b.data(), 10, tmp_.file("absent"), 0});
    FAIL() << "expected kIoError";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kIoError);
    bool has_errno = false;
    for (const auto& [k, v] : e.details()) {
      if (k == "errno") has_errno = std::get<std::int64_t>(v) == ENOENT;
    }
    EXPECT_TRUE(has_errno);
  }
}

TEST_P(AioEngineTest, TruncationUnderAPendingReadIsAShortRead) {
  MAKE_ENGINE(probe);
  probe.reset();
  // One 4 KiB block at a time from disk (the file is dropped from the page
  // cache), so the read lasts long enough for the truncation to land under it.
  AioConfig c = config_for(GetParam(), 4096);
  c.queue_depth = 1;
  c.threads = 1;
  auto engine = AioEngine::create(c);
  const std::string path = tmp_.file("trunc");
  const std::size_t n = 48u << 20;
  write_file(path, std::vector<unsigned char>(n, 0xab));
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_EQ(::fdatasync(fd), 0);
  ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  ::close(fd);
  Buffer b(n, 0);
  const auto h = engine->submit({IoOp::kRead, b.data(), static_cast<std::int64_t>(n), path, 0});
  ASSERT_EQ(::truncate(path.c_str(), 1 << 20), 0);
  try {
    engine->wait(h);
    FAIL() << "a read of a file truncated under it must not succeed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kShortRead) << e.what();
  }
}

// ENOSPC-like failure: a child process limited by RLIMIT_FSIZE writes past the
// limit; the write fails with kNoSpace (EFBIG) and the bytes written before
// stay readable.
TEST_P(AioEngineTest, FullFileSystemFailsTheWriteAndKeepsEarlierBytes) {
  MAKE_ENGINE(engine);
  engine.reset();
  const std::string path = tmp_.file("full");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = {1 << 20, 1 << 20};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    auto e = AioEngine::create(config_for(GetParam()));
    std::vector<unsigned char> first(1 << 19, 0x11), second(1 << 20, 0x22);
    Buffer b1(first.size(), 0), b2(second.size(), 0);
    std::memcpy(b1.data(), first.data(), first.size());
    std::memcpy(b2.data(), second.data(), second.size());
    e->wait(e->submit({IoOp::kWrite, b1.data(), 1 << 19, path, 0}));
    try {
      e->wait(e->submit({IoOp::kWrite, b2.data(), 1 << 20, path, 1 << 19}));
      ::_exit(2);  // reported success
    } catch (const Error& err) {
      ::_exit(err.code() == StatusCode::kNoSpace ? 0 : 3);
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0) << "2: the failed write reported success; 3: wrong status";
  const auto on_disk = read_file(path);
  ASSERT_GE(on_disk.size(), 1u << 19);
  for (std::size_t i = 0; i < (1u << 19); ++i) ASSERT_EQ(on_disk[i], 0x11) << i;
}

TEST_P(AioEngineTest, AlignedRequestsNeedNoBounceOrPageCache) {
  MAKE_ENGINE(engine);
  Buffer b(1 << 20, 0);
  engine->wait(engine->submit({IoOp::kWrite, b.data(), 1 << 20, tmp_.file("a"), 8192}));
  engine->wait(engine->submit({IoOp::kRead, b.data(), 1 << 20, tmp_.file("a"), 8192}));
  const auto s = engine->stats();
  EXPECT_EQ(s.bytes_written, 1u << 20);
  EXPECT_EQ(s.bytes_read, 1u << 20);
  EXPECT_EQ(s.bounce_bytes, 0u);
  if (GetParam() == IoBackend::kLibaio) {
    EXPECT_EQ(s.page_cache_bytes, 0u);
  } else {
    EXPECT_EQ(s.page_cache_bytes, 2u << 20);
  }
}

TEST_P(AioEngineTest, RequestsEndingPastTheLargestOffsetAreRefusedAtSubmit) {
  MAKE_ENGINE(engine);
  const std::string path = tmp_.file("far");
  Buffer b(8192, 0);
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const std::pair<std::int64_t, std::int64_t> cases[] = {
      {kMax - 15, 4096}, {kMax - 4095, 4096}, {kMax / 2 + 1, kMax / 2 + 1}, {1, kMax}, {kMax, 1}};
  for (const auto& [offset, bytes] : cases) {
    for (const IoOp op : {IoOp::kWrite, IoOp::kRead}) {
      const Error e = zcore::testing_support::error_of(
          [&] { engine->submit({op, b.data(), bytes, path, offset}); });
      EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << offset << " + " << bytes << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("largest file offset"), std::string::npos) << e.what();
    }
  }
  EXPECT_FALSE(fs::exists(path));  // refused before the file was created
  EXPECT_EQ(engine->pending(), 0);
  engine->wait(engine->submit({IoOp::kWrite, b.data(), 100, path, 0}));
}

// Submits to a FIFO on another thread; a regression that blocks in open() is
// released by opening the FIFO's other end, so the test fails instead of hanging.
void expect_fifo_refused_promptly(AioEngine& engine, IoOp op, const std::string& fifo) {
  Buffer b(4096, 0);
  std::promise<std::string> outcome;
  std::thread submitter([&] {
    try {
      engine.submit({op, b.data(), 4096, fifo, 0});
      outcome.set_value("accepted");
    } catch (const Error& e) {
      outcome.set_value(e.code() == StatusCode::kInvalidArgument ? e.what() : "wrong code: " + std::string(e.what()));
    }
  });
  auto future = outcome.get_future();
  if (future.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    const int peer = ::open(fifo.c_str(), O_RDWR | O_NONBLOCK);
    submitter.join();
    ::close(peer);
    FAIL() << "submit blocked on the FIFO " << fifo;
  }
  submitter.join();
  const std::string what = future.get();
  EXPECT_NE(what.find("is a FIFO"), std::string::npos) << what;
}

TEST_P(AioEngineTest, NonRegularFilesAreRefusedWithoutBlocking) {
  MAKE_ENGINE(engine);
  const std::string fifo = tmp_.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  expect_fifo_refused_promptly(*engine, IoOp::kRead, fifo);
  expect_fifo_refused_promptly(*engine, IoOp::kWrite, fifo);
  Buffer b(4096, 0);
  const std::pair<std::string, std::string> others[] = {
      {"/dev/null", "a character device"}, {"/dev/zero", "a character device"}, {tmp_.dir(), "a directory"}};
  for (const auto& [path, kind] : others) {
    for (const IoOp op : {IoOp::kRead, IoOp::kWrite}) {
      const Error e = zcore::testing_support::error_of([&] { engine->submit({op, b.data(), 4096, path, 0}); });
      EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << path;
      EXPECT_NE(std::string(e.what()).find(path + " is " + kind), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(engine->pending(), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, AioEngineTest,
                         ::testing::Values(IoBackend::kLibaio, IoBackend::kThreadPool),
                         [](const auto& info) { return std::string(zcore::io_backend_name(info.param)); });

TEST(AioEngineConfig, RejectsBadSettingsNamingTheField) {
  AioConfig c;
  c.block_size = 1000;
  try {
    AioEngine::create(c);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("block_size"), std::string::npos);
  }
  c = AioConfig{};
  c.queue_depth = 0;
  EXPECT_THROW(AioEngine::create(c), Error);
  c = AioConfig{};
  c.threads = 0;
  EXPECT_THROW(AioEngine::create(c), Error);
}

TEST(AioEngineConfig, AutoPicksLibaioWhereODirectWorks) {
  if (!zcore::libaio_compiled()) GTEST_SKIP() << "zcore was built without libaio (THREADPOOL)";
  TempDir tmp;
  if (!zcore::direct_io_unsupported_reason(tmp.dir()).empty()) {
    GTEST_SKIP() << "the build tree's filesystem refuses O_DIRECT";
  }
  AioConfig c;
  c.probe_directory = tmp.dir();
  EXPECT_EQ(AioEngine::create(c)->backend(), IoBackend::kLibaio);
}

}  // namespace
