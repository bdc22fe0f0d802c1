// The libaio backend of the I/O engine (compiled only with ZCORE_WITH_LIBAIO).
//
// Each worker owns one io context, created once with room for queue_depth
// iocbs, and a slot per iocb. It keeps as many blocks in flight as it has
// free slots: after every io_getevents it refills the freed slots from the
// shared queue before waiting again, so the device queue stays full while
// work remains. Bounce buffers belong to slots (allocated on first need), so
// they never exceed threads * queue_depth * block_size bytes.
#include <libaio.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "aio_internal.h"
#include "zcore/host_memory.h"

namespace zcore::aio {
namespace {

// The kernel's io_getevents, called directly: libaio.a defines its wrapper
// as the versioned symbol io_getevents@@LIBAIO_0.4, which cannot be linked
// statically into a shared module (ld: "version node not found"), and the
// wheel must not depend on libaio.so. Returns the event count or -errno.
int get_events(io_context_t ctx, long min_nr, long nr, struct io_event* events) {
  const long rc = ::syscall(SYS_io_getevents, ctx, min_nr, nr, events, nullptr);
  return rc < 0 ? -errno : static_cast<int>(rc);
}

class LibaioEngine final : public QueuedEngine {
 public:
  LibaioEngine(const AioConfig& config, std::string reason)
      : QueuedEngine(config, IoBackend::kLibaio, std::move(reason)),
        bounce_memory_(static_cast<std::int64_t>(config.threads) * config.queue_depth *
                           config.block_size,
                       LockPolicy::kTry),
        workers_(static_cast<std::size_t>(config.threads)) {
    for (Worker& w : workers_) {
      const int rc = io_setup(config.queue_depth, &w.ctx);
      if (rc != 0) {
        destroy_contexts();
        throw Error(StatusCode::kSystemError,
                    std::string("io_setup(") + std::to_string(config.queue_depth) +
                        ") failed: " + std::strerror(-rc) +
                        "; raise /proc/sys/fs/aio-max-nr or lower threads * queue_depth",
                    {{"errno", std::int64_t{-rc}}});
      }
      w.slots.resize(static_cast<std::size_t>(config.queue_depth));
    }
    for (Worker& w : workers_) w.thread = std::thread([this, &w] { run(w); });
  }

  ~LibaioEngine() override {
    stop_workers();
    for (Worker& w : workers_) w.thread.join();
    destroy_contexts();
  }

 private:
  struct Slot {
    struct iocb cb {};
    Work work;
    std::unique_ptr<HostBuffer> bounce;
  };
  struct Worker {
    io_context_t ctx = nullptr;
    std::vector<Slot> slots;
    std::thread thread;
  };

  void destroy_contexts() {
    for (Worker& w : workers_) {
      if (w.ctx != nullptr) io_destroy(w.ctx);
      w.ctx = nullptr;
    }
  }

  unsigned char* bounce_of(Slot& s) {
    return s.bounce ? static_cast<unsigned char*>(s.bounce->data()) : nullptr;
  }

  // Fills the iocb of a slot for the block's remaining bytes. False when the
  // block could not be prepared (it is then finished with an error).
  bool prepare(Slot& s) {
    Work& w = s.work;
    if (w.block.mode == BlockMode::kBounce && !s.bounce) {
      try {
        s.bounce = bounce_memory_.allocate(config().block_size, kIoAlignment);
      } catch (const Error& e) {
        abandon(w, e);
        return false;
      }
    }
    const bool read = w.request->io.op == IoOp::kRead;
    if (!read && w.block.mode == BlockMode::kBounce && w.transferred == 0) {
      fill_bounce(w, bounce_of(s));
    }
    void* target = w.target(bounce_of(s));
    const auto n = static_cast<std::size_t>(w.remaining());
    if (read) {
      io_prep_pread(&s.cb, w.fd(), target, n, w.position());
    } else {
      io_prep_pwrite(&s.cb, w.fd(), target, n, w.position());
    }
    s.cb.data = &s;
    return true;
  }

  void run(Worker& worker) {
    const std::size_t depth = worker.slots.size();
    std::vector<Slot*> free_slots;
    for (Slot& s : worker.slots) free_slots.push_back(&s);
    std::vector<Slot*> resume;  // slots whose block stopped short and continues
    std::vector<Work> taken;
    std::vector<struct iocb*> batch;
    std::vector<struct io_event> events(depth);
    std::size_t in_flight = 0;

    for (;;) {
      batch.clear();
      for (Slot* s : resume) {
        if (prepare(*s)) {
          batch.push_back(&s->cb);
        } else {
          free_slots.push_back(s);
        }
      }
      resume.clear();
      taken.clear();
      const bool idle = in_flight == 0 && batch.empty();
      take(taken, free_slots.size(), idle);
      if (idle && taken.empty()) return;  // stopped and drained
      for (Work& w : taken) {
        if (skip_if_failed(w)) continue;
        Slot* s = free_slots.back();
        free_slots.pop_back();
        s->work = std::move(w);
        if (prepare(*s)) {
          batch.push_back(&s->cb);
        } else {
          free_slots.push_back(s);
        }
      }
      submit(worker, batch, free_slots, resume);
      in_flight = depth - free_slots.size() - resume.size();
      if (in_flight == 0) continue;

      int n;
      do {
        n = get_events(worker.ctx, 1, static_cast<long>(depth), events.data());
      } while (n == -EINTR);
      for (int i = 0; i < n; ++i) {
        Slot* s = static_cast<Slot*>(events[i].data);
        // io_event.res carries the byte count, or -errno, in an unsigned long.
        const auto result = static_cast<std::int64_t>(static_cast<long>(events[i].res));
        if (on_transfer(s->work, result, bounce_of(*s))) {
          resume.push_back(s);
        } else {
          free_slots.push_back(s);
        }
      }
    }
  }

  // Submits the batch; an iocb the kernel refuses is finished with its error
  // (a resubmission would fail the same way).
  void submit(Worker& worker, std::vector<struct iocb*>& batch, std::vector<Slot*>& free_slots,
              std::vector<Slot*>& resume) {
    std::size_t done = 0;
    while (done < batch.size()) {
      const int rc = io_submit(worker.ctx, static_cast<long>(batch.size() - done), batch.data() + done);
      if (rc > 0) {
        done += static_cast<std::size_t>(rc);
        continue;
      }
      if (rc == -EINTR) continue;
      Slot* s = static_cast<Slot*>(batch[done]->data);
      if (on_transfer(s->work, rc == 0 ? -EIO : rc, bounce_of(*s))) {
        resume.push_back(s);
      } else {
        free_slots.push_back(s);
      }
      ++done;
    }
  }

  HostMemory bounce_memory_;
  std::vector<Worker> workers_;
};

}  // namespace

std::unique_ptr<AioEngine> make_libaio_engine(const AioConfig& config, std::string reason) {
  return std::make_unique<LibaioEngine>(config, std::move(reason));
}

}  // namespace zcore::aio
