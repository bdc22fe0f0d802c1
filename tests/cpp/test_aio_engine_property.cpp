// Property test of the I/O engine, on both backends: seeded random batches of
// concurrent reads and writes (random files, offsets, sizes, buffer
// alignments and engine configs), with refused requests of every error class
// mixed in while the batch is in flight, against a model that keeps each
// file's expected bytes in a plain vector. Files are checked with ::pread at
// the end of every engine's life, and the engine's counters against the bytes
// the test moved. ZCORE_AIO_PROPERTY_ROUNDS and ZCORE_AIO_PROPERTY_SEED set
// the length and seed (bench/aio_property.sh runs it longer); a failure names
// both, so it can be replayed.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "scratch_dir.h"
#include "zcore/aio_engine.h"
#include "zcore/status.h"

namespace fs = std::filesystem;
using zcore::AioConfig;
using zcore::AioEngine;
using zcore::Error;
using zcore::IoBackend;
using zcore::IoOp;
using zcore::IoRequest;
using zcore::StatusCode;

namespace {

constexpr std::int64_t kSector = zcore::kIoAlignment;
constexpr std::int64_t kMaxOffset = 4 << 20;  // writes start anywhere in the first 4 MiB
constexpr std::int64_t kMaxBytes = 1 << 20;   // and move up to 1 MiB
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
constexpr int kFiles = 3;
constexpr int kRefusalKinds = 10;  // the cases of probe_refusal()
constexpr int kMaxBatch = 8;               // requests in flight at once
constexpr std::uint64_t kRoundsPerEngine = 8;  // then a fresh engine with another random config
constexpr std::uint64_t kDefaultRounds = 64;   // per backend: a few seconds in CI
constexpr std::uint64_t kDefaultSeed = 21;
constexpr auto kStallLimit = std::chrono::seconds(60);

std::uint64_t env_number(const char* name, std::uint64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const std::uint64_t value = std::strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || text[0] == '-') {
    ADD_FAILURE() << name << " must be a non-negative integer, got '" << text << "'";
    return fallback;
  }
  return value;
}

class TempDir : public zcore::testing_support::ScratchDir {
 public:
  TempDir() : ScratchDir("aio-property") {}
};

// Memory for one request: the bytes handed to the engine start `shift` bytes
// past a page boundary, between guard bytes that catch an engine touching
// memory outside the request (ASan cannot: it is all one allocation).
class GuardedBuffer {
 public:
  GuardedBuffer(std::size_t bytes, std::size_t shift)
      : bytes_(bytes), storage_(bytes + shift + 3 * kGuard, kGuardByte) {
    const auto first = reinterpret_cast<std::uintptr_t>(storage_.data()) + kGuard;
    begin_ = kGuard + (kSector - first % kSector) % kSector + shift;
  }
  unsigned char* data() { return storage_.data() + begin_; }
  bool guards_intact() const {
    const auto is_guard = [](unsigned char c) { return c == kGuardByte; };
    return std::all_of(storage_.begin(), storage_.begin() + begin_, is_guard) &&
           std::all_of(storage_.begin() + begin_ + bytes_, storage_.end(), is_guard);
  }

 private:
  static constexpr std::size_t kGuard = 4096;
  static constexpr unsigned char kGuardByte = 0xa5;
  std::size_t bytes_;
  std::vector<unsigned char> storage_;
  std::size_t begin_ = 0;
};

// Bytes of one request that the header says go through bounce buffers and
// through the page cache. Thread pool: all through the page cache. libaio
// (O_DIRECT): partial head and tail sectors are bounced for reads and cached
// for writes; the whole sectors between are bounced when the buffer address
// is not congruent to the offset.
struct Routing {
  std::int64_t bounce = 0, page_cache = 0;
};

Routing expected_routing(IoBackend backend, IoOp op, std::int64_t offset, std::int64_t bytes, const void* buffer) {
  if (backend == IoBackend::kThreadPool) return {0, bytes};
  const std::int64_t end = offset + bytes;
  const std::int64_t head_end = std::min((offset + kSector - 1) / kSector * kSector, end);
  const std::int64_t tail_begin = std::max(end / kSector * kSector, head_end);
  const std::int64_t partial = (head_end - offset) + (end - tail_begin);
  const auto address = reinterpret_cast<std::uintptr_t>(buffer);
  const std::int64_t whole = address % kSector == std::uintptr_t(offset % kSector) ? 0 : tail_begin - head_end;
  return op == IoOp::kRead ? Routing{partial + whole, 0} : Routing{whole, partial};
}

struct ModelFile {
  std::string path;
  bool exists = false;
  std::vector<unsigned char> bytes;  // what the file must hold once every write is waited for
};

// A request in flight and what the model expects of it.
struct InFlight {
  zcore::IoHandle handle = 0;
  IoOp op = IoOp::kRead;
  int file = 0;
  std::int64_t offset = 0, bytes = 0;
  std::size_t shift = 0;
  std::unique_ptr<GuardedBuffer> buffer;
  std::vector<unsigned char> expected;  // reads: the model's bytes when submitted

  std::int64_t end() const { return offset + bytes; }
  std::string describe() const {
    return std::string(op == IoOp::kRead ? "read" : "write") + " of " + std::to_string(bytes) + " bytes at " +
           std::to_string(offset) + " of file " + std::to_string(file) + " (buffer shift " +
           std::to_string(shift) + ")";
  }
};

// What the engine's stats must say: the sums over requests it accepted.
struct Counters {
  std::uint64_t requests = 0, bytes_read = 0, bytes_written = 0, bounce = 0, page_cache = 0;
};

class PropertyRun {
 public:
  PropertyRun(IoBackend backend, std::uint64_t seed, const TempDir& dir, std::atomic<long>& progress)
      : backend_(backend), rng_(seed), dir_(dir), progress_(progress) {
    for (int i = 0; i < kFiles; ++i) {
      ModelFile& f = files_.emplace_back();
      f.path = dir.file("file" + std::to_string(i));
      if (i == kFiles - 1) continue;  // the last file starts absent: the first write creates it
      f.bytes.resize(static_cast<std::size_t>(uniform(0, 2 * kMaxBytes)));
      fill_random(f.bytes.data(), f.bytes.size());
      const int fd = ::open(f.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      EXPECT_EQ(::pwrite(fd, f.bytes.data(), f.bytes.size(), 0), static_cast<ssize_t>(f.bytes.size()));
      ::close(fd);
      f.exists = true;
    }
  }

  void run(std::uint64_t rounds) {
    for (std::uint64_t r = 0; r < rounds && !::testing::Test::HasFailure(); ++r) {
      if (r % kRoundsPerEngine == 0) {
        if (engine_) finish_engine();
        start_engine();
      }
      SCOPED_TRACE("round " + std::to_string(r) + " on " + config_text_);
      try {
        round(r % kRoundsPerEngine == 0);
      } catch (const Error& e) {
        ADD_FAILURE() << "unexpected zcore::Error: " << e.what();
        return;  // the engine is destroyed (waiting for what is in flight) before the batch
      }
    }
    if (engine_ && !::testing::Test::HasFailure()) finish_engine();
  }

 private:
  std::int64_t uniform(std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng_);
  }
  bool one_in(int n) { return uniform(0, n - 1) == 0; }
  template <typename T>
  const T& pick(const std::vector<T>& v) { return v[std::size_t(uniform(0, std::int64_t(v.size()) - 1))]; }

  void fill_random(unsigned char* p, std::size_t n) {
    for (std::size_t i = 0; i < n; i += 8) {
      const std::uint64_t word = rng_();
      std::memcpy(p + i, &word, std::min<std::size_t>(8, n - i));
    }
  }

  void start_engine() {
    AioConfig c;
    c.backend = backend_;
    const std::int64_t blocks[] = {kSector, 4 * kSector, 16 * kSector, 256 * kSector};
    c.block_size = blocks[uniform(0, 3)];
    c.queue_depth = static_cast<int>(uniform(1, 32));
    c.threads = static_cast<int>(uniform(1, 4));
    config_text_ = std::string(zcore::io_backend_name(backend_)) + " block_size=" +
                   std::to_string(c.block_size) + " queue_depth=" + std::to_string(c.queue_depth) +
                   " threads=" + std::to_string(c.threads);
    engine_ = AioEngine::create(c);
    counters_ = Counters{};
  }

  // Every request was waited for: the engine's counters add up to what the
  // test moved, and the files on disk are the model's.
  void finish_engine() {
    SCOPED_TRACE("end of engine " + config_text_);
    EXPECT_EQ(engine_->pending(), 0);
    const zcore::AioStats s = engine_->stats();
    EXPECT_EQ(s.requests, counters_.requests);
    EXPECT_EQ(s.bytes_read, counters_.bytes_read);
    EXPECT_EQ(s.bytes_written, counters_.bytes_written);
    EXPECT_EQ(s.bounce_bytes, counters_.bounce);
    EXPECT_EQ(s.page_cache_bytes, counters_.page_cache);
    engine_.reset();
    for (const ModelFile& f : files_) {
      if (!f.exists) {
        EXPECT_FALSE(fs::exists(f.path)) << f.path;
        continue;
      }
      std::vector<unsigned char> disk(static_cast<std::size_t>(fs::file_size(f.path)));
      const int fd = ::open(f.path.c_str(), O_RDONLY);
      EXPECT_EQ(::pread(fd, disk.data(), disk.size(), 0), static_cast<ssize_t>(disk.size())) << f.path;
      ::close(fd);
      ASSERT_EQ(disk.size(), f.bytes.size()) << "size of " << f.path;
      const auto diff = std::mismatch(disk.begin(), disk.end(), f.bytes.begin()).first;
      EXPECT_TRUE(diff == disk.end()) << f.path << " differs from the model at byte " << (diff - disk.begin());
    }
  }

  void round(bool first_round) {
    // The file sizes whatever completes first: reads stay inside them, as a
    // write of this batch may or may not have extended the file yet.
    std::vector<std::int64_t> settled;
    for (const ModelFile& f : files_) settled.push_back(static_cast<std::int64_t>(f.bytes.size()));
    const std::int64_t n = uniform(1, kMaxBatch);
    for (std::int64_t i = 0; i < n; ++i) submit_random(settled);
    if (first_round) {  // every kind of refusal at least once per engine, then now and then
      for (int kind = 0; kind < kRefusalKinds; ++kind) probe_refusal(kind);
    } else if (one_in(2)) {
      probe_refusal(static_cast<int>(uniform(0, kRefusalKinds - 1)));
    }
    wait_batch();
  }

  std::int64_t random_size() {
    switch (uniform(0, 4)) {
      case 0: return uniform(1, 64);
      case 1: return uniform(1, 3 * kSector);
      case 2: return kSector * uniform(1, kMaxBytes / kSector);
      case 3: return std::max<std::int64_t>(1, engine_->config().block_size + uniform(-2, 2));
      default: return uniform(1, kMaxBytes);
    }
  }

  std::int64_t random_offset(std::int64_t file_size) {
    switch (uniform(0, 3)) {
      case 0: return kSector * uniform(0, kMaxOffset / kSector);
      case 1: return uniform(0, kMaxOffset);
      case 2: return std::max<std::int64_t>(0, file_size + uniform(-kSector, kSector));  // about the end
      default: return uniform(0, kSector - 1);
    }
  }

  // An offset next to a request of the batch on the same file (just after
  // its end or just before its start), so the two share a sector; -1 if none.
  std::int64_t neighbour_offset(int file, std::int64_t bytes) {
    std::vector<const InFlight*> same;
    for (const InFlight& p : batch_) {
      if (p.file == file) same.push_back(&p);
    }
    if (same.empty()) return -1;
    const InFlight& p = *pick(same);
    return one_in(2) ? p.end() + uniform(0, 64) : p.offset - bytes - uniform(0, 64);
  }

  // Two requests of one batch may share a sector, but not a byte that one of
  // them writes: the engine orders nothing between concurrent requests.
  bool conflicts(const InFlight& r) const {
    return std::any_of(batch_.begin(), batch_.end(), [&](const InFlight& p) {
      return p.file == r.file && p.offset < r.end() && r.offset < p.end() &&
             (p.op == IoOp::kWrite || r.op == IoOp::kWrite);
    });
  }

  void submit_random(const std::vector<std::int64_t>& settled) {
    for (int attempt = 0; attempt < 16; ++attempt) {
      InFlight r;
      r.file = static_cast<int>(uniform(0, kFiles - 1));
      const std::int64_t size = settled[static_cast<std::size_t>(r.file)];
      r.op = size > 0 && one_in(2) ? IoOp::kRead : IoOp::kWrite;
      r.bytes = random_size();
      const std::int64_t next_to = one_in(2) ? neighbour_offset(r.file, r.bytes) : -1;
      r.offset = next_to >= 0 ? next_to : random_offset(size);
      if (r.op == IoOp::kWrite) r.offset = std::min(r.offset, kMaxOffset);  // files stay under 5 MiB
      if (r.op == IoOp::kRead) {  // inside the settled size; sometimes ending at its very end
        r.offset = one_in(4) ? std::max<std::int64_t>(0, size - r.bytes) : std::min(r.offset, size - 1);
        r.bytes = std::min(r.bytes, size - r.offset);
      }
      if (conflicts(r)) continue;
      submit(std::move(r));
      return;
    }
  }

  void submit(InFlight r) {
    switch (uniform(0, 2)) {
      case 0: r.shift = 0; break;                                                   // page-aligned
      case 1: r.shift = static_cast<std::size_t>(r.offset % kSector); break;        // congruent to the offset
      default: r.shift = static_cast<std::size_t>(uniform(1, kSector - 1)); break;  // misaligned
    }
    r.buffer = std::make_unique<GuardedBuffer>(static_cast<std::size_t>(r.bytes), r.shift);
    ModelFile& f = files_[static_cast<std::size_t>(r.file)];
    const auto end = static_cast<std::size_t>(r.end());
    if (r.op == IoOp::kWrite) {
      fill_random(r.buffer->data(), static_cast<std::size_t>(r.bytes));
    } else {
      r.expected.assign(f.bytes.begin() + r.offset, f.bytes.begin() + r.end());
    }
    r.handle = engine_->submit({r.op, r.buffer->data(), r.bytes, f.path, r.offset});
    ++progress_;
    const Routing route = expected_routing(backend_, r.op, r.offset, r.bytes, r.buffer->data());
    ++counters_.requests;
    (r.op == IoOp::kRead ? counters_.bytes_read : counters_.bytes_written) += std::uint64_t(r.bytes);
    counters_.bounce += std::uint64_t(route.bounce);
    counters_.page_cache += std::uint64_t(route.page_cache);
    if (r.op == IoOp::kWrite) {  // the model takes the bytes now: no request of the batch reads them
      f.bytes.resize(std::max(f.bytes.size(), end));
      std::copy(r.buffer->data(), r.buffer->data() + r.bytes, f.bytes.begin() + r.offset);
      f.exists = true;
    }
    batch_.push_back(std::move(r));
  }

  // One request the engine must refuse at submit, while the batch is in
  // flight: it changes no file (the model stays right) and queues nothing.
  void probe_refusal(int kind) {
    GuardedBuffer buffer(kMaxBytes, 0);  // big enough for any probe, should one be accepted by mistake
    const std::string absent = dir_.file("absent" + std::to_string(absent_count_++));
    IoRequest io{one_in(2) ? IoOp::kRead : IoOp::kWrite, buffer.data(), uniform(1, kMaxBytes),
                 one_in(2) ? absent : pick(files_).path, uniform(0, kMaxOffset)};
    StatusCode code = StatusCode::kInvalidArgument;
    switch (kind) {
      case 0: io.offset = one_in(2) ? -1 : uniform(kMin, -1); break;
      case 1: io.bytes = one_in(2) ? 0 : uniform(kMin, 0); break;
      case 2: io.buffer = nullptr; break;
      case 3:  // offset + bytes overflows int64
        io.offset = kMax - uniform(0, 2 * kMaxBytes);
        io.bytes = (kMax - io.offset) + uniform(1, kMaxBytes);
        break;
      case 4:  // ends in the last sector below 2^63, where rounding the end up to a sector overflows
        io.offset = kMax - uniform(0, kSector - 2) - io.bytes;
        break;
      case 5: io.path = fifo_path(); break;  // opening it must not wait for a peer
      case 6: io.path = dir_.dir(); break;
      case 7: io.path = "/dev/null"; break;
      case 8:  // a file that does not exist is not created by a read
        io.op = IoOp::kRead;
        io.path = absent;
        code = StatusCode::kIoError;
        break;
      default: {  // past the end of a file that no write of the batch may be extending
        std::vector<const ModelFile*> quiet;
        for (std::size_t i = 0; i < files_.size(); ++i) {
          const bool written = std::any_of(batch_.begin(), batch_.end(), [&](const InFlight& p) {
            return p.file == static_cast<int>(i) && p.op == IoOp::kWrite;
          });
          if (files_[i].exists && !written) quiet.push_back(&files_[i]);
        }
        if (quiet.empty()) return;
        const ModelFile& f = *pick(quiet);
        const auto size = static_cast<std::int64_t>(f.bytes.size());
        const std::int64_t offset =
            one_in(4) ? size + uniform(0, kSector) : std::max<std::int64_t>(0, size - uniform(0, kMaxBytes / 2));
        const std::int64_t bytes = std::max<std::int64_t>(size - offset, 0) + uniform(1, kSector);
        io = {IoOp::kRead, buffer.data(), bytes, f.path, offset};
        code = StatusCode::kFileTooSmall;
      }
    }
    expect_refused(io, code);
    EXPECT_FALSE(fs::exists(absent)) << "a refused request created " << absent;
  }

  void expect_refused(const IoRequest& io, StatusCode code) {
    const std::string what = std::string(io.op == IoOp::kRead ? "read" : "write") + " of " +
                             std::to_string(io.bytes) + " bytes at " + std::to_string(io.offset) + " of " + io.path +
                             (io.buffer == nullptr ? " with a null buffer" : "");
    const std::int64_t pending = engine_->pending();
    try {
      const zcore::IoHandle h = engine_->submit(io);
      ADD_FAILURE() << what << " was accepted; expected " << zcore::status_code_name(code);
      try {
        engine_->wait(h);  // the buffer must outlive it
      } catch (const Error&) {
      }
      return;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << what << ": " << e.what();
    }
    ++progress_;
    EXPECT_EQ(engine_->pending(), pending) << "a refused " << what << " left a request behind";
  }

  std::string fifo_path() {
    const std::string path = dir_.file("fifo");
    if (!fs::exists(path)) EXPECT_EQ(::mkfifo(path.c_str(), 0644), 0);
    return path;
  }

  // Waits in a random order, some requests by polling first, and sometimes
  // the rest of the batch with wait_all.
  void wait_batch() {
    std::shuffle(batch_.begin(), batch_.end(), rng_);
    const std::size_t wait_all_from =
        one_in(4) ? static_cast<std::size_t>(uniform(0, std::int64_t(batch_.size()))) : batch_.size();
    for (std::size_t i = 0; i < wait_all_from; ++i) {
      if (one_in(2)) {
        while (!engine_->poll(batch_[i].handle)) std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      engine_->wait(batch_[i].handle);
      ++progress_;
      check(batch_[i]);
    }
    if (wait_all_from < batch_.size()) {
      engine_->wait_all();
      ++progress_;
      for (std::size_t i = wait_all_from; i < batch_.size(); ++i) check(batch_[i]);
    }
    EXPECT_EQ(engine_->pending(), 0);
    batch_.clear();
  }

  void check(const InFlight& r) {
    EXPECT_TRUE(r.buffer->guards_intact()) << "the engine wrote outside the buffer of the " << r.describe();
    if (r.op != IoOp::kRead) return;
    const unsigned char* got = r.buffer->data();
    const auto diff = std::mismatch(r.expected.begin(), r.expected.end(), got).first;
    EXPECT_TRUE(diff == r.expected.end()) << "the " << r.describe() << " differs from the model at byte "
                                          << (diff - r.expected.begin());
  }

  IoBackend backend_;
  std::mt19937_64 rng_;
  const TempDir& dir_;
  std::atomic<long>& progress_;  // bumped on every submit and wait: the watchdog's sign of life
  std::vector<ModelFile> files_;
  Counters counters_;
  std::string config_text_;
  int absent_count_ = 0;
  std::vector<InFlight> batch_;  // before engine_: destroyed after it, so no buffer is freed while in flight
  std::unique_ptr<AioEngine> engine_;
};

// Runs `body` on its own thread and fails instead of hanging the suite when
// `progress` stops moving for kStallLimit: first by opening the FIFO's other
// end (which releases a submit blocked opening it), else by aborting.
void run_with_watchdog(const std::atomic<long>& progress, const std::string& fifo, const std::string& replay,
                       const std::function<void()>& body) {
  auto done = std::async(std::launch::async, body);
  long seen = progress.load();
  auto since = std::chrono::steady_clock::now();
  while (done.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready) {
    const auto now = std::chrono::steady_clock::now();
    if (progress.load() != seen) {
      seen = progress.load();
      since = now;
    } else if (now - since > kStallLimit) {
      const int peer = ::open(fifo.c_str(), O_RDWR | O_NONBLOCK);
      const bool released = done.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
      if (peer >= 0) ::close(peer);
      if (!released) {
        std::fprintf(stderr, "the I/O engine made no progress for %lld s (%s); aborting\n",
                     static_cast<long long>(kStallLimit.count()), replay.c_str());
        std::abort();
      }
      ADD_FAILURE() << "a submit blocked until the other end of " << fifo << " was opened";
      break;
    }
  }
  try {
    done.get();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception: " << e.what();
  }
}

class AioEnginePropertyTest : public ::testing::TestWithParam<IoBackend> {};

TEST_P(AioEnginePropertyTest, RandomConcurrentRequestsMatchAByteModel) {
  TempDir dir;
  if (GetParam() == IoBackend::kLibaio) {
    if (!zcore::libaio_compiled()) GTEST_SKIP() << "zcore was built without libaio (THREADPOOL)";
    const std::string why = zcore::direct_io_unsupported_reason(dir.dir());
    if (!why.empty()) GTEST_SKIP() << why;
  }
  const std::uint64_t rounds = env_number("ZCORE_AIO_PROPERTY_ROUNDS", kDefaultRounds);
  const std::uint64_t seed = env_number("ZCORE_AIO_PROPERTY_SEED", kDefaultSeed);
  const std::string replay = "replay with ZCORE_AIO_PROPERTY_SEED=" + std::to_string(seed) +
                             " ZCORE_AIO_PROPERTY_ROUNDS=" + std::to_string(rounds);
  SCOPED_TRACE(replay);
  std::atomic<long> progress{0};
  const IoBackend backend = GetParam();
  run_with_watchdog(progress, dir.file("fifo"), replay, [&] {
    SCOPED_TRACE(replay);  // traces are per thread
    PropertyRun(backend, seed, dir, progress).run(rounds);
  });
}

INSTANTIATE_TEST_SUITE_P(Backends, AioEnginePropertyTest,
                         ::testing::Values(IoBackend::kLibaio, IoBackend::kThreadPool),
                         [](const auto& info) { return std::string(zcore::io_backend_name(info.param)); });

}  // namespace
