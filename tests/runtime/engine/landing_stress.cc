// Stress of the engine core's fetch lifecycle, built with a sanitizer by
// test_engine_sanitized.py: prefetches into landing memory that are consumed, discarded,
// orphaned by a new epoch or left in flight at shutdown, interleaved with write-backs of
// the same bytes, from several threads, and (host tier) reads of those bytes where they lie
// (Engine::ReadInPlace), and fetches visited where they landed (Engine::VisitLanded: hits,
// mismatches, no ticket, and a visit racing a new epoch of its stream from another thread).
// Every consumed fetch, read in place or landed visit must see the bytes last written,
// throughout the visit; fetches are poisoned at submission, so a landing buffer handed to
// another fetch while a visit still reads it is overwritten by that submitting thread: a
// data race for TSan, stale bytes for the check. ASan/TSan report any use of freed memory
// or data race.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/tier.h"

using namespace tpusync;

namespace {

constexpr uint64_t kBlock = 64 << 10;
constexpr uint64_t kBlocks = 64;
constexpr int kThreads = 3;
constexpr int kRounds = 300;

#define CHECK(cond)                                                       \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::fprintf(stderr, "check failed at line %d: %s\n", __LINE__, #cond); \
      std::abort();                                                       \
    }                                                                     \
  } while (0)

void Fill(std::vector<uint8_t>& buf, uint8_t value) { std::memset(buf.data(), value, buf.size()); }

// True if every one of `bytes` bytes at `p` is `value`, checked twice with a pause between,
// so that a buffer reused under the visit is seen (and raced) while it is read.
bool HoldsThroughout(const uint8_t* p, uint64_t bytes, uint8_t value) {
  for (int pass = 0; pass < 2; ++pass) {
    for (uint64_t i = 0; i < bytes; ++i) {
      if (p[i] != value) return false;
    }
    if (pass == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const bool file_tier = argc > 1 && std::strcmp(argv[1], "file") == 0;
  // "host-split": no debug delay, so that each wait reads on its own thread (ReadHere), and
  // every read is split with the copy helper, which the three threads contend for.
  const bool split = argc > 1 && std::strcmp(argv[1], "host-split") == 0;
  EngineOptions options;
  options.num_workers = 2;
  options.debug_delay_us = split ? 0 : 50;
  options.split_read_bytes = split ? kBlock : 0;
  options.poison_fetches = true;  // Each fetch's landing buffer is written at submission.
  auto engine = Engine::Create(options);
  CHECK(engine.ok());
  std::unique_ptr<Engine> e = std::move(*engine);
  std::unique_ptr<Tier> tier;
  if (file_tier) {
    FileTierOptions o;
    o.layout = {kBlock, kBlocks, 0};
    o.directory = argc > 2 ? argv[2] : "/tmp";
    auto t = OpenFileTier(o);
    CHECK(t.ok());
    tier = std::move(*t);
  } else {
    HostTierOptions o;
    o.layout = {kBlock, kBlocks, 0};
    auto t = OpenHostTier(o);
    CHECK(t.ok());
    tier = std::move(*t);
  }
  auto index = e->AddTier(std::move(tier));
  CHECK(index.ok());
  const int t = *index;

  std::atomic<int> failures{0};
  std::atomic<int> landed_visits{0};
  std::atomic<bool> done{false};
  // A stream whose epochs another thread keeps starting over: its fetches are discarded
  // at any moment, except one whose landing buffer a visit already holds.
  const int64_t shared = e->OpenStream();
  CHECK(e->BeginEpoch(shared).ok());
  std::thread epochs([&] {
    while (!done.load()) {
      CHECK(e->BeginEpoch(shared).ok());
      std::this_thread::sleep_for(std::chrono::microseconds(300));
    }
  });
  std::vector<std::thread> threads;
  for (int id = 0; id < kThreads; ++id) {
    threads.emplace_back([&, id] {
      const int64_t stream = e->OpenStream();
      CHECK(e->BeginEpoch(stream).ok());
      // Each thread owns its blocks: [id * 16, id * 16 + 16).
      const uint64_t base = static_cast<uint64_t>(id) * 16 * kBlock;
      std::vector<uint8_t> data(kBlock), dst(2 * kBlock);
      for (int round = 0; round < kRounds; ++round) {
        const uint8_t value = static_cast<uint8_t>(round * 7 + id);
        const uint64_t at = base + (round % 16) * kBlock;
        Fill(data, value);
        TransferRequest write;
        write.tier = t;
        write.direction = Direction::kMemoryToTier;
        auto owned = std::make_shared<AlignedBuffer>(kBlock);
        std::memcpy(owned->data(), data.data(), kBlock);
        write.segments.push_back({at, owned->data(), kBlock});
        write.owned_memory = owned;
        write.detached = true;
        CHECK(e->Submit(std::move(write)).ok());

        FetchRequest fetch;
        fetch.tier = t;
        fetch.stream = stream;
        fetch.segments.push_back({at, kBlock / 2, kBlock});
        auto ticket = e->SubmitFetch(fetch);
        CHECK(ticket.ok());
        // A visit of landed bytes: each must be the write ordered before the fetch.
        auto visit_value = [&](const std::vector<const uint8_t*>& src, CopyHelper*) {
          CHECK(src.size() == 1);
          if (!HoldsThroughout(src[0], kBlock, value)) failures++;
          landed_visits++;
          return Status::Ok();
        };
        switch (round % 4) {
          case 0: {  // Consumed: must see the write ordered before it.
            bool hit = false;
            if (round % 8 == 4) {  // Where it landed.
              CHECK(e->VisitLanded(*ticket, fetch, visit_value, &hit).ok());
              break;
            }
            CHECK(e->CompleteFetch(*ticket, fetch, dst.data(), dst.size(), &hit).ok());
            for (uint64_t i = 0; i < kBlock; ++i) {
              if (dst[kBlock / 2 + i] != value) {
                failures++;
                break;
              }
            }
            break;
          }
          case 1:  // Retired by the next start.
            e->Discard(*ticket);
            break;
          case 2:  // A dropped state: orphaned, discarded by the next epoch.
            CHECK(e->BeginEpoch(stream).ok());
            break;
          case 3: {  // A mismatched wait: fetches itself.
            FetchRequest other = fetch;
            other.segments[0].dst_offset = 0;
            bool hit = true;
            if (round % 8 == 7) {  // Where its own fetch landed.
              CHECK(e->VisitLanded(*ticket, other, visit_value, &hit).ok());
              CHECK(!hit);
              break;
            }
            CHECK(e->CompleteFetch(*ticket, other, dst.data(), dst.size(), &hit).ok());
            CHECK(!hit);
            for (uint64_t i = 0; i < kBlock; ++i) {
              if (dst[i] != value) {
                failures++;
                break;
              }
            }
            break;
          }
        }
        if (round % 3 == 1) {
          // No ticket: read now into fresh landing memory (on a host tier, in place).
          bool hit = true;
          CHECK(e->VisitLanded(kNoTicket, fetch, visit_value, &hit).ok());
          CHECK(!hit);
        }
        if (round % 3 == 2) {
          // A fetch of the shared stream, whose epoch may start over before the visit takes
          // it (then it is gone: "unknown ticket") but never while the visit reads it.
          FetchRequest racing = fetch;
          racing.stream = shared;
          auto t2 = e->SubmitFetch(racing);
          CHECK(t2.ok());
          bool hit = false;
          Status st = e->VisitLanded(*t2, racing, visit_value, &hit);
          CHECK(st.ok() || st.code() == StatusCode::kNotFound);
        }
        if (!file_tier && round % 2 == 0) {
          // Read where it lies (ReadInPlace): after the write-back of the same bytes, half
          // of it checked on the copy helper where the engine has one.
          FetchRequest here;
          here.tier = t;
          here.stream = stream;
          here.segments.push_back({at, 0, kBlock});
          Status read = e->ReadInPlace(
              here, [&](const std::vector<const uint8_t*>& src, CopyHelper* helper) {
                std::atomic<int> stale{0};
                auto check = [&](uint64_t lo, uint64_t hi) {
                  for (uint64_t i = lo; i < hi; ++i) {
                    if (src[0][i] != value) {
                      stale++;
                      break;
                    }
                  }
                };
                const bool helped = helper && helper->TryStart([&] { check(kBlock / 2, kBlock); });
                check(0, helped ? kBlock / 2 : kBlock);
                if (helped) helper->Join();
                if (stale.load() != 0) failures++;
                return Status::Ok();
              });
          CHECK(read.ok());
        }
      }
      // One fetch left in flight at shutdown on purpose.
      FetchRequest last;
      last.tier = t;
      last.stream = stream;
      last.segments.push_back({base, 0, 4 * kBlock});
      CHECK(e->SubmitFetch(last).ok());
    });
  }
  for (auto& th : threads) th.join();
  done = true;
  epochs.join();
  if (landed_visits.load() == 0) {
    std::fprintf(stderr, "nothing was visited where it landed\n");
    return 1;
  }
  if (!file_tier && e->Stats().in_place_reads == 0) {
    std::fprintf(stderr, "nothing was read in place\n");
    return 1;
  }
  if (split && e->Stats().split_reads == 0) {
    std::fprintf(stderr, "no read was split with the copy helper\n");
    return 1;
  }
  e->Shutdown();
  e.reset();
  if (failures.load() != 0) {
    std::fprintf(stderr, "%d consumed fetches held stale bytes\n", failures.load());
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
