#include "zcore/prefetch.h"

namespace zcore {

PrefetchResult PrefetchScheduler::schedule(const ExecutionTrace& trace,
                                           const ParamGroupTable& groups,
                                           const PrefetchRequest& request,
                                           std::vector<PrefetchCandidate>* out) {
  out->clear();
  PrefetchResult result{trace.size(), false, PrefetchCandidate{-1, 0}};
  if (request.bucket_elements <= 0) {
    result.frontier = request.scan_from;
    return result;
  }
  if (taken_.size() < groups.size()) taken_.resize(groups.size(), 0);
  ++call_;
  std::int64_t ahead = request.ahead_elements;
  std::int64_t headroom = request.live_headroom;
  for (std::size_t use = request.scan_from; use < trace.size(); ++use) {
    const GroupId g = trace.at(use);
    const auto slot = static_cast<std::size_t>(g);
    if (groups.state(g) != GroupState::kSharded || taken_[slot] == call_) continue;
    const std::int64_t numel = groups.numel(g);
    if (ahead > 0 && ahead + numel > request.bucket_elements) {
      result.frontier = use;
      return result;
    }
    if (!groups.persistent(g) && numel > headroom) {
      result.frontier = use;
      result.blocked = true;
      result.blocker = PrefetchCandidate{g, use};
      return result;
    }
    taken_[slot] = call_;
    ahead += numel;
    if (!groups.persistent(g)) headroom -= numel;
    out->push_back(PrefetchCandidate{g, use});
  }
  return result;
}

}  // namespace zcore
