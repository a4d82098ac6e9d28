// Unit test of the hazard scoreboard (ffi/engine/scoreboard.h) on its own, without an
// engine: which registered transfers may start, and what completion releases. Prints "ok"
// and exits 0 when every check passes; otherwise prints each failed check and exits 1.
#include <cstdio>
#include <vector>

#include "engine/scoreboard.h"

namespace {

using tpusync::Footprint;
using tpusync::Scoreboard;

int failures = 0;

#define CHECK(cond)                                                  \
  do {                                                               \
    if (!(cond)) {                                                   \
      std::printf("FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond);  \
      ++failures;                                                    \
    }                                                                \
  } while (0)

const int kTierA = 1, kTierB = 2;
const void* const kA = &kTierA;
const void* const kB = &kTierB;

// One range [begin, end) of `tier`.
Footprint Range(const void* tier, bool write, uint64_t begin, uint64_t end) {
  Footprint f;
  f.resource = tier;
  f.write = write;
  f.Add(begin, end - begin);
  f.Seal();
  return f;
}

// Distinct keys for the transfers of one case.
struct Keys {
  int k[8];
  Scoreboard::Key operator[](int i) const { return &k[i]; }
};

void WriteAfterOverlappingReadWaits() {
  Keys t;
  Scoreboard board;
  board.AddQueued(t[0], Range(kA, false, 0, 100));
  board.AddQueued(t[1], Range(kA, true, 50, 150));
  CHECK(!board.Blocked(t[0]));
  CHECK(board.Blocked(t[1]));
  CHECK(board.FirstStartable() == t[0]);
  board.Start(t[0]);
  CHECK(board.Blocked(t[1]));  // A running read still holds its bytes.
  CHECK(board.FirstStartable() == nullptr);
  board.Remove(t[0]);
  CHECK(!board.Blocked(t[1]));
  CHECK(board.FirstStartable() == t[1]);
  // And a read after a write waits for the write.
  board.AddQueued(t[2], Range(kA, false, 149, 200));
  CHECK(board.Blocked(t[2]));
}

void NonOverlappingTransfersDoNotOrder() {
  Keys t;
  Scoreboard board;
  board.AddQueued(t[0], Range(kA, true, 0, 100));
  board.AddQueued(t[1], Range(kA, true, 200, 300));
  board.AddQueued(t[2], Range(kA, false, 400, 500));
  board.AddQueued(t[3], Range(kB, true, 0, 100));  // Same bytes of another tier.
  CHECK(!board.Blocked(t[1]));
  CHECK(!board.Blocked(t[2]));
  CHECK(!board.Blocked(t[3]));
  // Several ranges each: interleaved but disjoint, then one that hits a later range.
  Footprint a, b, c;
  a.resource = b.resource = c.resource = kA;
  a.write = true;
  a.Add(300, 10);
  a.Add(0, 10);
  a.Add(100, 10);
  a.Seal();
  b.Add(10, 90);
  b.Add(110, 190);
  b.Seal();
  c.Add(500, 1);
  c.Add(305, 1);
  c.Seal();
  CHECK(!tpusync::Conflicts(a, b));
  CHECK(tpusync::Conflicts(a, c));
  CHECK(tpusync::Conflicts(c, a));
}

void TwoReadsDoNotOrder() {
  Keys t;
  Scoreboard board;
  board.AddRunning(t[0], Range(kA, false, 0, 100));
  board.AddQueued(t[1], Range(kA, false, 0, 100));
  board.AddQueued(t[2], Range(kA, false, 50, 60));
  CHECK(!board.Blocked(t[1]));
  CHECK(!board.Blocked(t[2]));
  CHECK(board.FirstStartable() == t[1]);
  CHECK(!board.ConflictsWithAny(Range(kA, false, 0, 1000)));
  CHECK(board.ConflictsWithAny(Range(kA, true, 99, 100)));
}

void AdjacentRangesDoNotConflictButOneByteDoes() {
  CHECK(!tpusync::Conflicts(Range(kA, true, 0, 100), Range(kA, true, 100, 200)));
  CHECK(!tpusync::Conflicts(Range(kA, true, 100, 200), Range(kA, false, 0, 100)));
  CHECK(tpusync::Conflicts(Range(kA, true, 0, 101), Range(kA, true, 100, 200)));
  CHECK(tpusync::Conflicts(Range(kA, false, 100, 200), Range(kA, true, 199, 200)));
  Keys t;
  Scoreboard board;
  board.AddRunning(t[0], Range(kA, true, 0, 100));
  board.AddQueued(t[1], Range(kA, true, 100, 200));
  board.AddQueued(t[2], Range(kA, false, 99, 100));
  CHECK(!board.Blocked(t[1]));
  CHECK(board.Blocked(t[2]));
  CHECK(board.FirstStartable() == t[1]);
  // Widened to hazard pages, adjacent bytes in one page do conflict; in two pages not.
  Footprint x, y;
  x.resource = y.resource = kA;
  x.write = true;
  x.Add(0, 100, 4096);
  y.Add(100, 10, 4096);
  x.Seal();
  y.Seal();
  CHECK(tpusync::Conflicts(x, y));
  Footprint p, q;
  p.resource = q.resource = kA;
  p.write = true;
  p.Add(0, 4096 - 512, 4096, 512);  // Pages start at 4096 k - 512: [0, 3584) is page 0.
  q.Add(4096 - 512, 10, 4096, 512);
  p.Seal();
  q.Seal();
  CHECK(!tpusync::Conflicts(p, q));
}

void CompletionReleasesWaitersInOrder() {
  Keys t;
  Scoreboard board;
  // Three writes of the same bytes, then a read of them: they run one after another.
  board.AddQueued(t[0], Range(kA, true, 0, 64));
  board.AddQueued(t[1], Range(kA, true, 32, 96));
  board.AddQueued(t[2], Range(kA, true, 0, 96));
  board.AddQueued(t[3], Range(kA, false, 60, 70));
  board.AddQueued(t[4], Range(kA, true, 1000, 1100));  // Unrelated: free from the start.
  std::vector<Scoreboard::Key> order;
  while (!board.empty()) {
    Scoreboard::Key next = board.FirstStartable();
    CHECK(next != nullptr);
    if (next == nullptr) break;
    board.Start(next);
    CHECK(board.FirstStartable() != next);
    order.push_back(next);
    // Everything runnable now starts before the first of them completes.
    if (next == t[0]) {
      Scoreboard::Key also = board.FirstStartable();
      CHECK(also == t[4]);
      board.Start(also);
      order.push_back(also);
      CHECK(board.FirstStartable() == nullptr);
      board.Remove(also);
    }
    board.Remove(next);
  }
  const std::vector<Scoreboard::Key> want = {t[0], t[4], t[1], t[2], t[3]};
  CHECK(order == want);

  // A reader registered as running waits for what Conflicting() named; removing them one
  // by one releases it only after the last.
  board.AddQueued(t[0], Range(kA, true, 0, 10));
  board.AddQueued(t[1], Range(kA, true, 5, 20));
  board.AddQueued(t[2], Range(kA, true, 500, 600));
  const Footprint read = Range(kA, false, 0, 20);
  const std::vector<Scoreboard::Key> earlier = board.Conflicting(read);
  CHECK((earlier == std::vector<Scoreboard::Key>{t[0], t[1]}));
  board.Start(t[0]);
  board.Remove(t[0]);
  CHECK(board.ConflictsWithAny(read));
  CHECK(board.FirstStartable() == t[1]);
  board.Start(t[1]);
  board.Remove(t[1]);
  CHECK(!board.ConflictsWithAny(read));
  board.AddRunning(t[3], read);
  // A later write of those bytes waits for the running read; removing it releases the write.
  board.AddQueued(t[4], Range(kA, true, 19, 30));
  CHECK(board.Blocked(t[4]));
  CHECK(board.FirstStartable() == t[2]);
  board.Remove(t[3]);
  CHECK(!board.Blocked(t[4]));
  board.Remove(t[7]);  // Unknown keys are ignored.
  CHECK(board.size() == 2);
  CHECK(board.Contains(t[2]) && board.Contains(t[4]) && !board.Contains(t[3]));
}

}  // namespace

int main() {
  WriteAfterOverlappingReadWaits();
  NonOverlappingTransfersDoNotOrder();
  TwoReadsDoNotOrder();
  AdjacentRangesDoNotConflictButOneByteDoes();
  CompletionReleasesWaitersInOrder();
  if (failures != 0) {
    std::printf("%d checks failed\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
