// Fork-join parallelism for the CPU kernels.
//
// The kernels are memory-bandwidth bound: they must use exactly the number of
// threads the caller asks for (Python passes torch.get_num_threads()), never
// more, and a call must not pay for creating threads. A process-wide pool of
// persistent workers runs the tasks; the calling thread takes part, so a call
// with `threads` = N wakes N - 1 workers.
#pragma once

#include <cstdint>
#include <functional>

namespace zcore {

// Runs task(i) for every i in [0, count), on at most `threads` threads (the
// caller included), and returns when all have finished. Tasks are handed out
// in index order from a shared counter. `task` must not throw. Concurrent
// callers are served one after another. threads < 1 counts as 1.
void parallel_for(std::int64_t count, int threads, const std::function<void(std::int64_t)>& task);

}  // namespace zcore
