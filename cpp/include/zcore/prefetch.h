// Prefetch scheduler: which parameter groups to start gathering ahead of
// their use, given the recorded trace, the current position in it, the
// prefetch bucket and the headroom left under the live-element budget.
//
// Policy (the same as DeepSpeed's, made explicit):
// - Walk the trace forward from the frontier; each sharded group is a
//   candidate once (a group used several times ahead is gathered for its
//   first use). Groups already gathered, in flight or in use cost nothing.
// - The bucket bounds the elements gathered ahead of use and not yet used
//   (those already in flight count): a candidate is taken while
//   ahead + numel <= bucket, or when nothing is ahead at all (so one group
//   larger than the bucket can still be prefetched alone). bucket 0 disables
//   prefetch.
// - The live budget bounds memory: a non-persistent candidate must fit in
//   the headroom. The walk stops at the first candidate that does not fit
//   (taking a later, smaller group would spend memory the earlier use needs
//   first) and reports it as `blocked`, so that the coordinator can displace
//   groups used later than it and call again.
//
// The frontier makes repeated calls cheap: every use in [position, frontier)
// was examined before and is gathered, in flight or taken, so the next call
// starts at the frontier. The coordinator moves the frontier back when it
// releases a group whose next use lies before it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "zcore/param_groups.h"
#include "zcore/trace.h"

namespace zcore {

struct PrefetchRequest {
  std::size_t scan_from;        // first trace use to examine (the frontier)
  std::int64_t bucket_elements;  // stage3_prefetch_bucket_size
  std::int64_t ahead_elements;   // gathered ahead of use and not used yet
  std::int64_t live_headroom;    // live budget minus live elements (may be <= 0)
};

struct PrefetchCandidate {
  GroupId group;
  std::size_t use;  // trace index of the use it is gathered for
};

struct PrefetchResult {
  std::size_t frontier;       // first use not examined (trace size when all were)
  bool blocked;               // stopped by the live budget, not by the bucket or the trace end
  PrefetchCandidate blocker;  // when blocked: the candidate that did not fit
};

class PrefetchScheduler {
 public:
  // Replaces `out` with the groups to gather now, in trace order.
  PrefetchResult schedule(const ExecutionTrace& trace, const ParamGroupTable& groups,
                          const PrefetchRequest& request, std::vector<PrefetchCandidate>* out);

 private:
  // Marks groups taken in the current call: taken_[g] == call_ (no clearing per call).
  std::vector<std::uint64_t> taken_;
  std::uint64_t call_ = 0;
};

}  // namespace zcore
