// The hazard scoreboard: which transfers may run now without breaking the engine's ordering
// contract (engine.h). Transfers that touch the same bytes of one tier, at least one of them
// a write, run in submission order; reads never order each other, and neither do transfers
// whose byte ranges only touch (one ends exactly where the other starts).
//
// The scoreboard knows nothing about what a transfer does: it holds, in submission order,
// each registered transfer's footprint (its tier, whether it writes, its byte ranges) and
// whether it is queued or running, under a key its owner chooses (unique while registered).
// Queued entries start in order when nothing earlier conflicts with them; an entry the caller
// runs on its own thread (a read in place) is registered as running, so later writes of its
// bytes wait for it. Removing an entry (the transfer ended, or was cancelled while queued)
// releases whatever waited for it. Not thread-safe: the engine calls it under its own mutex.
#ifndef TPUSYNC_ENGINE_SCOREBOARD_H_
#define TPUSYNC_ENGINE_SCOREBOARD_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

namespace tpusync {

// The bytes one transfer touches, as the scoreboard compares them.
struct Footprint {
  const void* resource = nullptr;  // Transfers on different resources (tiers) never conflict.
  bool write = false;
  // Half-open [begin, end) byte ranges, sorted by begin once Seal() ran.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;

  // Adds `bytes` from `offset` (nothing when 0), widened to whole hazard pages of
  // `granularity` bytes that start at k * granularity - `phase`. Ranges are kept in the
  // shifted coordinates (offset + phase): only their intersections matter.
  void Add(uint64_t offset, uint64_t bytes, uint64_t granularity = 1, uint64_t phase = 0);
  // Sorts the ranges; call it after the last Add(), before the footprint is compared.
  void Seal();
};

// True if `a` and `b` must run in submission order: same resource, at least one a write, and
// at least one byte in common.
bool Conflicts(const Footprint& a, const Footprint& b);

class Scoreboard {
 public:
  using Key = const void*;

  // Registers a transfer at the end of the submission order, not started yet.
  void AddQueued(Key key, Footprint footprint);
  // Registers a transfer that runs from now on (the caller checked it may, e.g. with
  // ConflictsWithAny or by waiting for Conflicting()): later conflicting ones wait for it.
  void AddRunning(Key key, Footprint footprint);
  // A queued entry starts running (it stays registered, and keeps blocking later ones).
  void Start(Key key);
  // The transfer ended or was cancelled: it blocks nothing any more. Unknown keys are ignored.
  void Remove(Key key);

  bool Contains(Key key) const;
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }

  // True if `key` is queued behind an earlier entry that conflicts with it.
  bool Blocked(Key key) const;
  // The earliest queued entry that nothing earlier conflicts with; null if none.
  Key FirstStartable() const;
  // Whether any registered entry, queued or running, conflicts with `footprint`.
  bool ConflictsWithAny(const Footprint& footprint) const;
  // The registered entries that conflict with `footprint`, in submission order.
  std::vector<Key> Conflicting(const Footprint& footprint) const;

 private:
  struct Entry {
    Key key;
    Footprint footprint;
    bool running;
  };
  // Whether an entry before entries_[index] conflicts with it.
  bool BlockedAt(size_t index) const;

  std::deque<Entry> entries_;  // Submission order.
};

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_SCOREBOARD_H_
