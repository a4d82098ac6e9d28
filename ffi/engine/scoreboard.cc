#include "scoreboard.h"

#include <algorithm>

namespace tpusync {

void Footprint::Add(uint64_t offset, uint64_t bytes, uint64_t granularity, uint64_t phase) {
  if (bytes == 0) return;
  const uint64_t g = granularity == 0 ? 1 : granularity;
  const uint64_t begin = offset + phase;
  const uint64_t end = offset + bytes + phase;
  ranges.emplace_back(begin - begin % g, (end + g - 1) - (end + g - 1) % g);
}

// The sweep in Conflicts() relies on the order.
void Footprint::Seal() { std::sort(ranges.begin(), ranges.end()); }

bool Conflicts(const Footprint& a, const Footprint& b) {
  if (a.resource != b.resource) return false;
  if (!a.write && !b.write) return false;  // Reads never conflict with reads.
  if (a.ranges.empty() || b.ranges.empty()) return false;
  // Both lists are sorted by start; a sweep finds any intersection.
  size_t i = 0, j = 0;
  while (i < a.ranges.size() && j < b.ranges.size()) {
    const auto& x = a.ranges[i];
    const auto& y = b.ranges[j];
    if (x.first < y.second && y.first < x.second) return true;
    if (x.second <= y.second) {
      ++i;
    } else {
      ++j;
    }
  }
  return false;
}

void Scoreboard::AddQueued(Key key, Footprint footprint) {
  entries_.push_back({key, std::move(footprint), false});
}

void Scoreboard::AddRunning(Key key, Footprint footprint) {
  entries_.push_back({key, std::move(footprint), true});
}

void Scoreboard::Start(Key key) {
  for (Entry& e : entries_) {
    if (e.key == key) {
      e.running = true;
      return;
    }
  }
}

void Scoreboard::Remove(Key key) {
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->key == key) {
      entries_.erase(it);
      return;
    }
  }
}

bool Scoreboard::Contains(Key key) const {
  return std::any_of(entries_.begin(), entries_.end(),
                     [key](const Entry& e) { return e.key == key; });
}

bool Scoreboard::BlockedAt(size_t index) const {
  for (size_t i = 0; i < index; ++i) {
    if (Conflicts(entries_[i].footprint, entries_[index].footprint)) return true;
  }
  return false;
}

bool Scoreboard::Blocked(Key key) const {
  for (size_t j = 0; j < entries_.size(); ++j) {
    if (entries_[j].key == key) return !entries_[j].running && BlockedAt(j);
  }
  return false;
}

Scoreboard::Key Scoreboard::FirstStartable() const {
  for (size_t j = 0; j < entries_.size(); ++j) {
    if (!entries_[j].running && !BlockedAt(j)) return entries_[j].key;
  }
  return nullptr;
}

bool Scoreboard::ConflictsWithAny(const Footprint& footprint) const {
  return std::any_of(entries_.begin(), entries_.end(), [&](const Entry& e) {
    return Conflicts(e.footprint, footprint);
  });
}

std::vector<Scoreboard::Key> Scoreboard::Conflicting(const Footprint& footprint) const {
  std::vector<Key> out;
  for (const Entry& e : entries_) {
    if (Conflicts(e.footprint, footprint)) out.push_back(e.key);
  }
  return out;
}

}  // namespace tpusync
