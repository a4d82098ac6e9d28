// The private extension module `jax_tpusync._tpusync`: the engine for Python (tiers,
// blocking and async transfers on numpy buffers, stats, timeline) and the capsules of the
// XLA FFI handlers. Blocking calls release the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/io_context.h"
#include "engine/pool_attention.h"
#include "engine/registry.h"
#include "engine/stream_copy.h"
#include "engine/tier.h"
#include "xla/cpu_ops.h"

namespace nb = nanobind;

namespace tpusync {
namespace {

// Raised in Python as jax_tpusync.TpusyncError (a RuntimeError).
struct TpusyncError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Bytes a tier should hold are gone (its file truncated or replaced under it).
struct TierDataLossError : TpusyncError {
  using TpusyncError::TpusyncError;
};

// InvalidArgument -> ValueError; DataLoss -> TierDataLossError; everything else ->
// TpusyncError (a RuntimeError).
void ThrowIfError(const Status& status) {
  if (status.ok()) return;
  if (status.code() == StatusCode::kInvalidArgument) throw nb::value_error(status.message().c_str());
  if (status.code() == StatusCode::kDataLoss) throw TierDataLossError(status.message());
  throw TpusyncError(status.message());
}

template <typename T>
T ValueOrThrow(StatusOr<T> s) {
  ThrowIfError(s.status());
  return std::move(*s);
}

using Int64Vector = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using AnyHostArray = nb::ndarray<nb::c_contig, nb::device::cpu>;

// Owns one engine registered under an id; close() unregisters and shuts it down.
class PyEngine {
 public:
  PyEngine(int num_workers, uint64_t io_chunk_bytes, int io_depth, bool huge_page_destinations,
           uint64_t max_inflight_bytes, double max_bytes_per_second,
           std::vector<int> worker_cpus, uint64_t split_read_bytes, bool poison_fetches,
           uint32_t debug_delay_us, bool record_timeline) {
    EngineOptions o;
    o.num_workers = num_workers;
    o.io_chunk_bytes = io_chunk_bytes;
    o.io_depth = io_depth;
    o.huge_page_destinations = huge_page_destinations;
    o.max_inflight_bytes = max_inflight_bytes;
    o.max_bytes_per_second = max_bytes_per_second;
    o.worker_cpus = std::move(worker_cpus);
    o.split_read_bytes = split_read_bytes;
    o.poison_fetches = poison_fetches;
    o.debug_delay_us = debug_delay_us;
    o.record_timeline = record_timeline;
    std::shared_ptr<Engine> engine = ValueOrThrow(Engine::Create(std::move(o)));
    engine_ = engine;
    id_ = EngineRegistry::Global().Add(std::move(engine));
  }

  ~PyEngine() { Close(); }

  int64_t id() const { return id_; }
  bool closed() const { return engine_ == nullptr; }

  void Close() {
    if (!engine_) return;
    std::shared_ptr<Engine> engine = std::move(engine_);
    EngineRegistry::Global().Remove(id_);
    nb::gil_scoped_release release;
    engine->Shutdown();
  }

  Engine& engine() { return *shared(); }

  // Calls that release the GIL hold a reference: close() on another thread must not destroy
  // the engine while they are still inside it.
  std::shared_ptr<Engine> shared() {
    if (!engine_) ThrowIfError(FailedPrecondition("engine " + std::to_string(id_) + " is closed"));
    return engine_;
  }

  int AddHostTier(uint64_t block_bytes, uint64_t num_blocks, const std::string& shm_name,
                  bool read_only) {
    HostTierOptions o{{block_bytes, num_blocks}, shm_name, read_only};
    return ValueOrThrow(engine().AddTier(ValueOrThrow(OpenHostTier(o))));
  }

  int AddFileTier(const std::string& directory, uint64_t block_bytes, uint64_t num_blocks,
                  const std::string& file_name, bool allow_direct_io,
                  uint64_t alignment_offset, bool read_only) {
    FileTierOptions o{{block_bytes, num_blocks, alignment_offset}, directory, file_name,
                      allow_direct_io, read_only};
    return ValueOrThrow(engine().AddTier(ValueOrThrow(OpenFileTier(o))));
  }

  nb::dict TierInfo(int tier) {
    Tier* t = ValueOrThrow(engine().GetTier(tier));
    nb::dict d;
    d["kind"] = t->kind();
    d["description"] = t->Describe();
    d["block_bytes"] = t->block_bytes();
    d["num_blocks"] = t->num_blocks();
    d["capacity_bytes"] = t->capacity_bytes();
    d["free_blocks"] = t->free_blocks();
    d["direct_io"] = t->direct_io();
    d["dio_alignment"] = t->dio_alignment();
    d["alignment_offset"] = t->alignment_offset();
    d["direct_read_bytes"] = t->direct_read_bytes();
    d["bounced_read_bytes"] = t->bounced_read_bytes();
    d["attached"] = t->attached();
    d["read_only"] = t->read_only();
    nb::dict regions;
    for (const NamedRegion& r : t->named_regions()) {
      regions[r.name.c_str()] = nb::make_tuple(r.first_block, r.num_blocks);
    }
    d["regions"] = regions;
    return d;
  }

  // (address, bytes) of a host tier's mapped data, which another engine (a network
  // transfer engine) may register and read or write in place.
  nb::tuple MappedMemory(int tier) {
    Tier* t = ValueOrThrow(engine().GetTier(tier));
    const uint8_t* base = t->MappedAt(0);
    if (base == nullptr) {
      ThrowIfError(InvalidArgument("tier " + std::to_string(tier) + " (" + t->Describe() +
                                   ") is not mapped in memory: only a host tier is"));
    }
    return nb::make_tuple(reinterpret_cast<uintptr_t>(base), t->capacity_bytes());
  }

  uint64_t Allocate(int tier, uint64_t count, const std::string& name) {
    return ValueOrThrow(ValueOrThrow(engine().GetTier(tier))->AllocateBlocks(count, name));
  }

  void Free(int tier, uint64_t first, uint64_t count) {
    ThrowIfError(ValueOrThrow(engine().GetTier(tier))->FreeBlocks(first, count));
  }

  // Segments i: tier bytes [tier_offsets[i], +sizes[i]) <-> buffer bytes [mem_offsets[i], ...).
  int64_t Submit(int tier, bool write, const Int64Vector& tier_offsets, AnyHostArray buffer,
                 const Int64Vector& mem_offsets, const Int64Vector& sizes, int32_t layer,
                 int32_t chunk) {
    const size_t n = tier_offsets.shape(0);
    if (mem_offsets.shape(0) != n || sizes.shape(0) != n) {
      ThrowIfError(InvalidArgument("tier_offsets, mem_offsets and sizes differ in length"));
    }
    if (!write && buffer.is_valid() && buffer.ndim() >= 0 && !buffer.data()) {
      ThrowIfError(InvalidArgument("buffer has no data"));
    }
    const uint64_t nbytes = buffer.nbytes();
    auto* base = static_cast<uint8_t*>(buffer.data());
    TransferRequest request;
    request.tier = tier;
    request.direction = write ? Direction::kMemoryToTier : Direction::kTierToMemory;
    request.tag = {layer, chunk};
    for (size_t i = 0; i < n; ++i) {
      int64_t t = tier_offsets(i), m = mem_offsets(i), s = sizes(i);
      if (t < 0 || m < 0 || s < 0) {
        ThrowIfError(InvalidArgument("segment " + std::to_string(i) + " has a negative field"));
      }
      if (static_cast<uint64_t>(m + s) > nbytes) {
        ThrowIfError(InvalidArgument("segment " + std::to_string(i) + " covers bytes [" +
                                     std::to_string(m) + ", " + std::to_string(m + s) +
                                     ") of a " + std::to_string(nbytes) + "-byte buffer"));
      }
      request.segments.push_back({static_cast<uint64_t>(t), base + m, static_cast<uint64_t>(s)});
    }
    std::shared_ptr<Engine> e = shared();
    StatusOr<Ticket> ticket = Status::Ok();
    {
      nb::gil_scoped_release release;  // Poisoning may touch many bytes.
      ticket = e->Submit(std::move(request));
    }
    return ValueOrThrow(std::move(ticket));
  }

  void Wait(int64_t ticket, double timeout_s) {
    std::shared_ptr<Engine> e = shared();
    Status st;
    {
      nb::gil_scoped_release release;
      st = e->Wait(ticket, timeout_s < 0 ? -1 : static_cast<int64_t>(timeout_s * 1e9));
    }
    ThrowIfError(st);
  }

  bool Poll(int64_t ticket) { return ValueOrThrow(engine().Poll(ticket)); }
  void Cancel(int64_t ticket) { ThrowIfError(engine().Cancel(ticket)); }

  void Drain() {
    std::shared_ptr<Engine> e = shared();
    Status st;
    {
      nb::gil_scoped_release release;
      st = e->Drain();
    }
    ThrowIfError(st);
  }

  void Mark(int32_t kind, int32_t layer, int32_t chunk) { engine().Mark(kind, {layer, chunk}); }

  int64_t OpenStream() { return engine().OpenStream(); }
  int32_t BeginEpoch(int64_t stream) { return ValueOrThrow(engine().BeginEpoch(stream)); }
  void CloseStream(int64_t stream) {
    if (engine_) engine_->CloseStream(stream);  // A closed engine has no streams left.
  }

  // The latest write-back guards of `stream`'s current epoch (Engine::LastGuards), or None.
  nb::object LastGuards(int64_t stream) {
    Engine::WriteGuards g;
    if (!engine().LastGuards(stream, &g)) return nb::none();
    nb::dict out;
    out["epoch"] = g.epoch;
    out["generation"] = g.generation;
    out["layer"] = g.layer;
    out["accepted"] = g.accepted;
    out["lengths"] = nb::cast(g.lengths);
    out["counts"] = nb::cast(g.counts);
    return out;
  }

  nb::dict Stats() {
    EngineStats s = engine().Stats();
    auto direction = [](const DirectionStats& d) {
      nb::dict out;
      out["bytes"] = d.bytes;
      out["requests"] = d.requests;
      out["segments"] = d.segments;
      out["bytes_per_segment"] = d.segments ? static_cast<double>(d.bytes) / d.segments : 0.0;
      out["busy_s"] = d.busy_ns * 1e-9;
      out["gbps"] = d.busy_ns > 0 ? static_cast<double>(d.bytes) / d.busy_ns : 0.0;
      return out;
    };
    nb::list tiers;
    for (const TierStats& t : s.tiers) {
      nb::dict d;
      d["fetch"] = direction(t.fetch);
      d["write_back"] = direction(t.write_back);
      tiers.append(d);
    }
    nb::dict d;
    d["tiers"] = tiers;
    d["waits"] = s.waits;
    d["prefetch_hits"] = s.prefetch_hits;
    d["prefetch_misses"] = s.prefetch_misses;
    d["split_reads"] = s.split_reads;
    d["in_place_reads"] = s.in_place_reads;
    d["landed_reads"] = s.landed_reads;
    d["wait_copy_bytes"] = s.wait_copy_bytes;
    d["wait_copy_s"] = static_cast<double>(s.wait_copy_ns) * 1e-9;
    d["wait_s"] = s.wait_ns * 1e-9;
    d["inflight_bytes_peak"] = s.inflight_bytes_peak;
    d["landing_bytes"] = s.landing_bytes;
    return d;
  }

  void ResetStats() { engine().ResetStats(); }

  // Lists of plain tuples; the Python layer turns them into records.
  nb::dict TakeTimeline() {
    Timeline t = engine().TakeTimeline();
    nb::list transfers, waits, marks;
    for (const TransferEvent& e : t.transfers) {
      transfers.append(nb::make_tuple(e.ticket, e.tier, static_cast<int>(e.direction),
                                      e.tag.layer, e.tag.chunk, e.bytes, e.submit_ns,
                                      e.start_ns, e.end_ns, e.ok));
    }
    for (const WaitEvent& e : t.waits) {
      waits.append(nb::make_tuple(e.ticket, e.tag.layer, e.tag.chunk, e.begin_ns, e.end_ns));
    }
    for (const MarkEvent& e : t.marks) {
      marks.append(nb::make_tuple(e.kind, e.tag.layer, e.tag.chunk, e.ns));
    }
    nb::dict d;
    d["transfers"] = transfers;
    d["waits"] = waits;
    d["marks"] = marks;
    return d;
  }

 private:
  std::shared_ptr<Engine> engine_;
  int64_t id_ = 0;
};

nb::capsule HandlerCapsule(void* fn) { return nb::capsule(fn); }

}  // namespace
}  // namespace tpusync

NB_MODULE(_tpusync, m) {
  using namespace tpusync;
  m.doc() = "Private engine bindings of jax_tpusync; use the jax_tpusync package instead.";
  nb::exception<TpusyncError> tpusync_error(m, "TpusyncError", PyExc_RuntimeError);
  nb::exception<TierDataLossError>(m, "TierDataLossError", tpusync_error);

  m.def("registrations", [] {
    nb::dict d;
    d["tpusync_start"] = HandlerCapsule(reinterpret_cast<void*>(TpusyncStartCpu));
    d["tpusync_wait"] = HandlerCapsule(reinterpret_cast<void*>(TpusyncWaitCpu));
    d["tpusync_write_back"] = HandlerCapsule(reinterpret_cast<void*>(TpusyncWriteBackCpu));
    d["tpusync_mark"] = HandlerCapsule(reinterpret_cast<void*>(TpusyncMarkCpu));
    d["tpusync_attend"] = HandlerCapsule(reinterpret_cast<void*>(TpusyncAttendCpu));
    d["tpusync_attend_landed"] =
        HandlerCapsule(reinterpret_cast<void*>(TpusyncAttendLandedCpu));
    d["tpusync_attend_spilled"] =
        HandlerCapsule(reinterpret_cast<void*>(TpusyncAttendSpilledCpu));
    return d;
  });
  // The process-wide engine registry, for the optional CUDA module (`_tpusync_cuda`),
  // whose handlers must resolve the same engine ids as this module.
  m.def("engine_registry_capsule", [] {
    return nb::capsule(&EngineRegistry::Global(), "tpusync.EngineRegistry");
  });
  m.def("monotonic_ns", &MonotonicNs);
  // Which build of the in-place attention's inner loops this CPU runs ("avx2", "baseline").
  m.def("pool_attention_isa", [] { return std::string(PoolAttentionIsa()); });
  m.def("huge_page_bytes", [](uintptr_t address, size_t bytes) {
    return HugePageBytes(reinterpret_cast<const void*>(address), bytes);
  });
  m.def("unlink_shm", [](const std::string& name) { ThrowIfError(UnlinkShmSegment(name)); });
  // Copies many host ranges over threads with streaming stores (CopyRanges); the addresses
  // come from jax_tpusync.runtime.host_copy, which checks the arrays and holds them meanwhile.
  m.def(
      "copy_ranges",
      [](Int64Vector dst, Int64Vector src, Int64Vector bytes, int threads) {
        size_t n = dst.shape(0);
        if (src.shape(0) != n || bytes.shape(0) != n) {
          throw nb::value_error("copy_ranges: dst, src and bytes must have the same length");
        }
        std::vector<CopyRange> ranges(n);
        for (size_t i = 0; i < n; ++i) {
          if (bytes(i) < 0) throw nb::value_error("copy_ranges: a range has bytes < 0");
          ranges[i] = {reinterpret_cast<void*>(static_cast<uintptr_t>(dst(i))),
                       reinterpret_cast<const void*>(static_cast<uintptr_t>(src(i))),
                       static_cast<size_t>(bytes(i))};
        }
        Status status;
        {
          nb::gil_scoped_release release;
          status = CopyRanges(ranges.data(), ranges.size(), threads);
        }
        ThrowIfError(status);
      },
      nb::arg("dst"), nb::arg("src"), nb::arg("bytes"), nb::arg("threads"));

  nb::class_<PyEngine>(m, "Engine")
      .def(nb::init<int, uint64_t, int, bool, uint64_t, double, std::vector<int>, uint64_t, bool,
                    uint32_t, bool>(),
           nb::arg("num_workers"), nb::arg("io_chunk_bytes"), nb::arg("io_depth"),
           nb::arg("huge_page_destinations"), nb::arg("max_inflight_bytes"),
           nb::arg("max_bytes_per_second"), nb::arg("worker_cpus"),
           nb::arg("split_read_bytes"), nb::arg("poison_fetches"),
           nb::arg("debug_delay_us"), nb::arg("record_timeline"))
      .def_prop_ro("id", &PyEngine::id)
      .def_prop_ro("closed", &PyEngine::closed)
      .def("close", &PyEngine::Close)
      .def("add_host_tier", &PyEngine::AddHostTier, nb::arg("block_bytes"),
           nb::arg("num_blocks"), nb::arg("shm_name"), nb::arg("read_only") = false)
      .def("add_file_tier", &PyEngine::AddFileTier, nb::arg("directory"),
           nb::arg("block_bytes"), nb::arg("num_blocks"), nb::arg("file_name"),
           nb::arg("allow_direct_io"), nb::arg("alignment_offset"),
           nb::arg("read_only") = false)
      .def("tier_info", &PyEngine::TierInfo, nb::arg("tier"))
      .def("mapped_memory", &PyEngine::MappedMemory, nb::arg("tier"))
      .def("allocate", &PyEngine::Allocate, nb::arg("tier"), nb::arg("count"), nb::arg("name"))
      .def("free", &PyEngine::Free, nb::arg("tier"), nb::arg("first"), nb::arg("count"))
      .def("submit", &PyEngine::Submit, nb::arg("tier"), nb::arg("write"),
           nb::arg("tier_offsets"), nb::arg("buffer"), nb::arg("mem_offsets"), nb::arg("sizes"),
           nb::arg("layer"), nb::arg("chunk"))
      .def("wait", &PyEngine::Wait, nb::arg("ticket"), nb::arg("timeout_s"))
      .def("poll", &PyEngine::Poll, nb::arg("ticket"))
      .def("cancel", &PyEngine::Cancel, nb::arg("ticket"))
      .def("drain", &PyEngine::Drain)
      .def("mark", &PyEngine::Mark, nb::arg("kind"), nb::arg("layer"), nb::arg("chunk"))
      .def("open_stream", &PyEngine::OpenStream)
      .def("begin_epoch", &PyEngine::BeginEpoch, nb::arg("stream"))
      .def("close_stream", &PyEngine::CloseStream, nb::arg("stream"))
      .def("last_guards", &PyEngine::LastGuards, nb::arg("stream"))
      .def("stats", &PyEngine::Stats)
      .def("reset_stats", &PyEngine::ResetStats)
      .def("take_timeline", &PyEngine::TakeTimeline);
}
