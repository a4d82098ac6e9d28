// XLA FFI handlers (platform "cpu") for the in-graph transfer ops. Their signatures (each
// operand, result and attribute, named) are in xla/op_signatures.h.
//
// start(passthrough, segments, tag, retire, owner, target, *deps) -> (passthrough, ticket)
//   Queues a fetch of `segments` and returns at once. The fetch lands in memory the engine
//   owns, never in an XLA buffer: XLA may copy, free or reuse any buffer between two ops
//   (it does copy a donated, aliased one in some graphs), so the only moment a buffer is
//   ours is while an op that holds it runs. `retire` (-1: none) is an earlier fetch for
//   the same slot that nobody waited for: it is discarded. `passthrough` (the layer's input
//   activation) is aliased through so that compute reading it is ordered after the start:
//   XLA's schedulers may otherwise sink a start past the compute it should overlap.
// wait(dst, ticket, segments, tag, owner, target, *deps) -> dst
//   Fills `dst` with `segments`: copies the ticket's landed bytes if it fetched exactly
//   these (tier bytes and offsets in dst), else reads them now. `deps` (the outputs of the
//   compute that overlaps the fetch) keep XLA from hoisting the wait above that compute;
//   lax.optimization_barrier does not. A prefetch is only ever an optimization, never a
//   source of stale KV, whatever buffer XLA hands the wait.
// write_back(src, segments, tag, owner, target, *deps) -> token
//   Copies the bytes out of `src` (XLA may reuse it as soon as we return) and writes them
//   to the tier in the background. The engine orders later fetches of the same bytes after it.
// mark(x, tag, *deps) -> x   records a timestamp in the engine timeline (compute spans).
// attend(q, segments, positions, tag, owner, target, *deps) -> (out, lse)
//   Attention of q (f32[batch, q_len, q_heads, head_dim]) over one unit's keys where they
//   lie in a memory tier (see engine/pool_attention.h): no byte is copied. `segments` are
//   the unit's fetch segments into a staging slot of `unit_len` rows ([2, batch,
//   unit_len] rows, K then V, which is never allocated); `positions` int32[3, batch] are
//   (first key position, valid keys, first query position). Each sequence's K and V
//   segments must cover exactly its valid keys' rows. out f32 like q, lse f32[batch,
//   q_len, q_heads]: the unit's normalized partial and its log-sum-exp. Rows are kv_dtype
//   values, or (tier_dtype != 0) a quantized tier's codes and per-head scales, which the
//   attention applies (no row is dequantized).
// attend_landed(q, ticket, segments, positions, tag, owner, target, *deps) -> (out, lse)
//   attend's attention over a unit that `ticket` fetched ahead into the engine's landing
//   memory (a file tier), read where it landed: the op waits for the fetch, compares it
//   with `segments` as wait does (a different, failed or missing fetch is read again now,
//   never trusted), and attends over the landing buffer, which the engine holds (not
//   pooled, freed or handed to another fetch) until the attention ends. No XLA buffer but
//   this op's out and lse is written. On a memory tier it reads in place as attend does.
// attend_spilled(q, spill_ticket, segments, spill_segments, positions, tag, owner, target,
//     spill_target, *deps) -> (out, lse)
//   A two-level cache's unit: its memory tier's rows (`segments`, `target`) read where they
//   lie, as attend does, and its spill tier's (`spill_segments`, `spill_target`) where
//   `spill_ticket`'s fetch landed, as attend_landed does, attended together in one pass.
//
// Segments are int32[n, 4] rows (block, offset_in_block, memory_offset, bytes): two int32
// fields address a 64-bit tier offset without requiring jax_enable_x64. `memory_offset` is
// a byte offset into the destination (fetch) or source (write-back) buffer; `dst_bytes`
// tells start how large the destination will be.
//
// `owner` is int32[4] (stream, epoch, generation, claims) from the state (see
// Engine::CheckOwner): an op of a superseded state fails before it moves a byte; the
// step's first op claims its generation. Stream 0: unchecked.
//
// `target` is int32[3] (engine id, tier, first block): operands, so that one compiled step
// serves every cache of one configuration. Segment blocks are relative to the first block.
//
// Region attributes (region_base, region_bytes, region_count, region_block_rows;
// region_bytes == 0 disables the check) describe how the caller carved its allocation:
// `region_count` regions of `region_bytes` from `region_base` (relative to the first
// block). Every segment must lie inside one region and, with region_block_rows, inside the
// block its row names, so a layer out of range or a row past its KV block fails loudly
// instead of reading or overwriting a neighbour's KV (see regions.h).
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/pool_attention.h"
#include "engine/regions.h"
#include "engine/registry.h"
#include "xla/ffi/api/ffi.h"
#include "xla/op_signatures.h"
#include "xla/status_adapter.h"

namespace tpusync {
namespace {

namespace ffi = xla::ffi;

StatusOr<std::shared_ptr<Engine>> LookupEngine(int64_t engine_id) {
  std::shared_ptr<Engine> engine = EngineRegistry::Global().Get(engine_id);
  if (!engine) {
    return FailedPrecondition("engine " + std::to_string(engine_id) +
                              " is closed or was never created (a jitted function outlived "
                              "its cache?)");
  }
  return engine;
}

TransferTag DecodeTag(const ffi::Buffer<ffi::S32>& tag) {
  TransferTag out;
  if (tag.element_count() >= 1) out.layer = tag.typed_data()[0];
  if (tag.element_count() >= 2) out.chunk = tag.typed_data()[1];
  return out;
}

// The op's engine and target (engine id, tier, first block).
struct Bound {
  std::shared_ptr<Engine> engine;
  OpTarget target;
};

StatusOr<Bound> Bind(const ffi::Buffer<ffi::S32>& target) {
  auto decoded = DecodeTarget(target.typed_data(), target.element_count());
  if (!decoded.ok()) return decoded.status();
  auto engine = LookupEngine(decoded->engine_id);
  if (!engine.ok()) return engine.status();
  return Bound{std::move(*engine), *decoded};
}

// Decodes int32[n, 4] rows against a buffer of `buffer_bytes` (see DecodeRows).
StatusOr<std::vector<FetchSegment>> DecodeSegments(const Bound& op,
                                                   const ffi::Buffer<ffi::S32>& segments,
                                                   uint64_t buffer_bytes,
                                                   const Regions& regions) {
  auto dims = segments.dimensions();
  if (dims.size() != 2 || dims[1] != 4) {
    return InvalidArgument("segments must be int32[n, 4]");
  }
  StatusOr<Tier*> t = op.engine->GetTier(op.target.tier);
  if (!t.ok()) return t.status();
  return DecodeRows(segments.typed_data(), dims[0], **t, buffer_bytes, regions,
                    op.target.first_block);
}

StatusOr<FetchRequest> DecodeFetch(const Bound& op, const ffi::Buffer<ffi::S32>& segments,
                                   uint64_t dst_bytes, const ffi::Buffer<ffi::S32>& tag,
                                   const Regions& regions, int64_t stream) {
  auto decoded = DecodeSegments(op, segments, dst_bytes, regions);
  if (!decoded.ok()) return decoded.status();
  FetchRequest request;
  request.tier = op.target.tier;
  request.segments = std::move(*decoded);
  request.tag = DecodeTag(tag);
  request.stream = stream;
  return request;
}

// Checks the state's (stream, epoch, generation, claims); returns the stream.
StatusOr<int64_t> CheckOwner(Engine& engine, const ffi::Buffer<ffi::S32>& owner) {
  if (owner.element_count() != 4) {
    return InvalidArgument("owner must be int32[4] (stream, epoch, generation, claims)");
  }
  const int32_t* o = owner.typed_data();
  if (o[0] == 0) return 0;
  TPUSYNC_RETURN_IF_ERROR(engine.CheckOwner(o[0], o[1], o[2], o[3] != 0));
  return o[0];
}

ffi::Error StartImpl(ffi::AnyBuffer passthrough, ffi::Buffer<ffi::S32> segments,
                     ffi::Buffer<ffi::S32> tag, ffi::BufferR0<ffi::S32> retire,
                     ffi::Buffer<ffi::S32> owner, ffi::Buffer<ffi::S32> target,
                     ffi::RemainingArgs /*deps*/, ffi::Result<ffi::AnyBuffer> passthrough_out,
                     ffi::Result<ffi::BufferR0<ffi::S32>> ticket_out, int64_t region_base,
                     int64_t region_bytes, int64_t region_count, int32_t region_block_rows,
                     int64_t dst_bytes) {
  auto op = Bind(target);
  if (!op.ok()) return ToFfiError(op.status());
  auto* engine = &op->engine;
  StatusOr<int64_t> stream = CheckOwner(**engine, owner);
  if (!stream.ok()) return ToFfiError(stream.status());
  if (passthrough_out->untyped_data() != passthrough.untyped_data()) {
    std::memcpy(passthrough_out->untyped_data(), passthrough.untyped_data(),
                passthrough.size_bytes());
  }
  const Ticket stale = retire.typed_data()[0];
  if (stale != kNoTicket) (*engine)->Discard(stale);
  if (dst_bytes < 0) return ToFfiError(InvalidArgument("dst_bytes must be >= 0"));
  auto request = DecodeFetch(*op, segments, static_cast<uint64_t>(dst_bytes), tag,
                             MakeRegions(region_base, region_bytes, region_count,
                                         region_block_rows),
                             *stream);
  if (!request.ok()) return ToFfiError(request.status());
  StatusOr<Ticket> ticket = (*engine)->SubmitFetch(std::move(*request));
  if (!ticket.ok()) return ToFfiError(ticket.status());
  ticket_out->typed_data()[0] = static_cast<int32_t>(*ticket);
  return ffi::Error::Success();
}

ffi::Error WaitImpl(ffi::AnyBuffer dst, ffi::BufferR0<ffi::S32> ticket,
                    ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::S32> tag,
                    ffi::Buffer<ffi::S32> owner, ffi::Buffer<ffi::S32> target,
                    ffi::RemainingArgs /*deps*/, ffi::Result<ffi::AnyBuffer> dst_out,
                    int64_t region_base, int64_t region_bytes, int64_t region_count,
                    int32_t region_block_rows) {
  auto op = Bind(target);
  if (!op.ok()) return ToFfiError(op.status());
  auto* engine = &op->engine;
  StatusOr<int64_t> stream = CheckOwner(**engine, owner);
  if (!stream.ok()) return ToFfiError(stream.status());
  if (dst_out->untyped_data() != dst.untyped_data()) {
    // Not aliased (XLA copied the operand): carry the other slots over. The fetched bytes
    // are written below into whichever buffer this op was given.
    std::memcpy(dst_out->untyped_data(), dst.untyped_data(), dst.size_bytes());
  }
  auto want = DecodeFetch(*op, segments, dst_out->size_bytes(), tag,
                          MakeRegions(region_base, region_bytes, region_count,
                                      region_block_rows),
                          *stream);
  if (!want.ok()) return ToFfiError(want.status());
  bool hit = false;
  return ToFfiError((*engine)->CompleteFetch(ticket.typed_data()[0], *want,
                                             static_cast<uint8_t*>(dst_out->untyped_data()),
                                             dst_out->size_bytes(), &hit));
}

ffi::Error WriteBackImpl(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> segments,
                         ffi::Buffer<ffi::S32> tag, ffi::Buffer<ffi::S32> owner,
                         ffi::Buffer<ffi::S32> target, ffi::RemainingArgs /*deps*/,
                         ffi::Result<ffi::BufferR0<ffi::S32>> token_out, int64_t region_base,
                         int64_t region_bytes, int64_t region_count,
                         int32_t region_block_rows) {
  auto op = Bind(target);
  if (!op.ok()) return ToFfiError(op.status());
  auto* engine = &op->engine;
  StatusOr<int64_t> stream = CheckOwner(**engine, owner);
  if (!stream.ok()) return ToFfiError(stream.status());
  auto decoded = DecodeSegments(
      *op, segments, src.size_bytes(),
      MakeRegions(region_base, region_bytes, region_count, region_block_rows));
  if (*stream != 0 && segments.dimensions().size() == 2) {
    // What this write-back's guards said, accepted or not (see Engine::RecordGuards).
    Engine::WriteGuards guards;
    guards.epoch = owner.typed_data()[1];
    guards.generation = owner.typed_data()[2];
    guards.layer = DecodeTag(tag).layer;
    guards.accepted = decoded.ok();
    GuardColumns(segments.typed_data(), segments.dimensions()[0], &guards.lengths,
                 &guards.counts);
    if (!guards.lengths.empty()) (*engine)->RecordGuards(*stream, std::move(guards));
  }
  if (!decoded.ok()) return ToFfiError(decoded.status());
  // Pack the source bytes into engine-owned memory; the segments then point into it.
  uint64_t total = 0;
  for (const FetchSegment& s : *decoded) total += s.bytes;
  auto owned = std::make_shared<AlignedBuffer>(total);
  TransferRequest request;
  request.tier = op->target.tier;
  request.direction = Direction::kMemoryToTier;
  request.tag = DecodeTag(tag);
  uint64_t at = 0;
  const auto* base = static_cast<const uint8_t*>(src.untyped_data());
  for (const FetchSegment& s : *decoded) {
    std::memcpy(owned->data() + at, base + s.dst_offset, s.bytes);
    request.segments.push_back({s.tier_offset, owned->data() + at, s.bytes});
    at += s.bytes;
  }
  request.owned_memory = std::move(owned);
  request.detached = true;
  StatusOr<Ticket> ticket = (*engine)->Submit(std::move(request));
  if (!ticket.ok()) return ToFfiError(ticket.status());
  token_out->typed_data()[0] = 0;
  return ffi::Error::Success();
}

ffi::Error MarkImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> tag, ffi::RemainingArgs /*deps*/,
                    ffi::Result<ffi::AnyBuffer> x_out, int64_t engine_id, int32_t kind) {
  auto engine = LookupEngine(engine_id);
  if (!engine.ok()) return ToFfiError(engine.status());
  if (x_out->untyped_data() != x.untyped_data()) {
    std::memcpy(x_out->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  (*engine)->Mark(kind, DecodeTag(tag));
  return ffi::Error::Success();
}

// One sequence's K (kv 0) or V (kv 1) rows of a unit: `rows` rows from unit row `row`.
struct RowPiece {
  int64_t row = 0;
  int64_t rows = 0;
  const uint8_t* data = nullptr;
};

// The unit's K and V rows of every sequence, paired into key spans. Every access is
// checked against what it is for: segments hold whole rows, and each sequence's K and V
// rows are exactly its valid keys' rows [0, valid[b]), no more, no fewer, no row twice.
StatusOr<std::vector<KeySpan>> PairRows(const std::vector<FetchSegment>& segments,
                                        const std::vector<const uint8_t*>& src,
                                        const AttentionShape& shape, int64_t unit_len,
                                        const int32_t* k_start, const int32_t* valid) {
  const uint64_t row_bytes = shape.row_bytes();
  const uint64_t seq_bytes = unit_len * row_bytes;
  std::vector<std::vector<RowPiece>> pieces(2 * shape.batch);  // [kv * batch + b]
  for (size_t i = 0; i < segments.size(); ++i) {
    const FetchSegment& f = segments[i];
    if (f.dst_offset % row_bytes != 0 || f.bytes % row_bytes != 0) {
      return InvalidArgument("segment " + std::to_string(i) + " is not whole rows of " +
                             std::to_string(row_bytes) + " bytes");
    }
    uint64_t dst = f.dst_offset, done = 0;
    while (done < f.bytes) {  // A segment may run on into the next sequence's rows.
      const uint64_t which = dst / seq_bytes, in_seq = dst % seq_bytes;
      const uint64_t take = std::min(f.bytes - done, seq_bytes - in_seq);
      pieces[which].push_back({static_cast<int64_t>(in_seq / row_bytes),
                               static_cast<int64_t>(take / row_bytes), src[i] + done});
      dst += take;
      done += take;
    }
  }
  std::vector<KeySpan> spans;
  for (int b = 0; b < shape.batch; ++b) {
    if (valid[b] < 0 || valid[b] > unit_len) {
      return InvalidArgument("sequence " + std::to_string(b) + " has " +
                             std::to_string(valid[b]) + " valid keys in a unit of " +
                             std::to_string(unit_len) + " rows");
    }
    auto& k = pieces[b];
    auto& v = pieces[shape.batch + b];
    for (auto* list : {&k, &v}) {
      std::sort(list->begin(), list->end(),
                [](const RowPiece& x, const RowPiece& y) { return x.row < y.row; });
      int64_t next = 0;
      for (const RowPiece& p : *list) {
        if (p.row != next) {
          return InvalidArgument(
              "the " + std::string(list == &k ? "K" : "V") + " rows of sequence " +
              std::to_string(b) + (p.row < next ? " overlap at row " : " skip to row ") +
              std::to_string(p.row) + " (its " + std::to_string(valid[b]) +
              " valid keys must be rows [0, " + std::to_string(valid[b]) + ") exactly)");
        }
        next += p.rows;
      }
      if (next != valid[b]) {
        return InvalidArgument("the " + std::string(list == &k ? "K" : "V") +
                               " rows of sequence " + std::to_string(b) + " cover " +
                               std::to_string(next) + " rows, but it has " +
                               std::to_string(valid[b]) + " valid keys");
      }
    }
    // Walk both lists, cutting at every boundary of either.
    size_t i = 0, j = 0;
    int64_t ki = 0, vj = 0;  // Rows used of k[i], v[j].
    for (int64_t row = 0; row < valid[b];) {
      const int64_t n = std::min(k[i].rows - ki, v[j].rows - vj);
      spans.push_back({b, static_cast<int32_t>(k_start[b] + row), static_cast<int32_t>(n),
                       k[i].data + ki * row_bytes, v[j].data + vj * row_bytes});
      row += n;
      ki += n;
      vj += n;
      if (ki == k[i].rows) ++i, ki = 0;
      if (vj == v[j].rows) ++j, vj = 0;
    }
  }
  return spans;
}

// What an attend op reads: its shape, its unit's fetch and each sequence's positions.
struct AttendPlan {
  AttentionShape shape;
  FetchRequest want;
  int64_t unit_len = 0;
  const int32_t* k_start = nullptr;  // [batch] first key position
  const int32_t* valid = nullptr;    // [batch] valid keys
  const int32_t* q_start = nullptr;  // [batch] first query position
  const int32_t* q_rows = nullptr;   // [batch] real query rows (null: every row is real)
};

StatusOr<AttendPlan> PlanAttend(const Bound& op, int64_t stream, const ffi::Buffer<ffi::F32>& q,
                                const ffi::Buffer<ffi::S32>& segments,
                                const ffi::Buffer<ffi::S32>& positions,
                                const ffi::Buffer<ffi::S32>& tag, const Regions& regions,
                                int64_t unit_len, int32_t kv_dtype, int32_t tier_dtype,
                                int32_t num_kv_heads, float scale, float soft_cap,
                                int32_t window) {
  auto dims = q.dimensions();
  if (dims.size() != 4) return InvalidArgument("q must be f32[batch, q_len, heads, dim]");
  AttendPlan plan;
  AttentionShape& shape = plan.shape;
  shape.batch = static_cast<int32_t>(dims[0]);
  shape.q_len = static_cast<int32_t>(dims[1]);
  shape.num_q_heads = static_cast<int32_t>(dims[2]);
  shape.head_dim = static_cast<int32_t>(dims[3]);
  shape.num_kv_heads = num_kv_heads;
  shape.kv_dtype = static_cast<KvDtype>(kv_dtype);
  shape.tier_dtype = static_cast<TierDtype>(tier_dtype);
  shape.scale = scale;
  shape.soft_cap = soft_cap;
  shape.window = window;
  TPUSYNC_RETURN_IF_ERROR(shape.Check());
  auto pdims = positions.dimensions();
  if (pdims.size() != 2 || (pdims[0] != 3 && pdims[0] != 4) || pdims[1] != shape.batch) {
    return InvalidArgument("positions must be int32[3 or 4, batch] (key start, valid keys, "
                           "query start[, real query rows])");
  }
  if (unit_len < 1) return InvalidArgument("unit_len must be >= 1");
  plan.unit_len = unit_len;
  const uint64_t buffer = 2 * static_cast<uint64_t>(shape.batch) * unit_len * shape.row_bytes();
  auto want = DecodeFetch(op, segments, buffer, tag, regions, stream);
  if (!want.ok()) return want.status();
  plan.want = std::move(*want);
  plan.k_start = positions.typed_data();
  plan.valid = plan.k_start + shape.batch;
  plan.q_start = plan.valid + shape.batch;
  if (pdims[0] == 4) {
    plan.q_rows = plan.q_start + shape.batch;
    for (int32_t b = 0; b < shape.batch; ++b) {
      if (plan.q_rows[b] < 0 || plan.q_rows[b] > shape.q_len) {
        return InvalidArgument("positions[3, " + std::to_string(b) + "] = " +
                               std::to_string(plan.q_rows[b]) +
                               " real query rows must be in [0, q_len = " +
                               std::to_string(shape.q_len) + "]");
      }
    }
  }
  return plan;
}

// The attention of `queries` over the unit's rows wherever they are (src[i]: segment i's
// bytes), into out and lse. Every row is checked against the sequence it belongs to first.
Status AttendRows(const AttendPlan& plan, const float* queries, uint64_t split_bytes,
                  const std::vector<const uint8_t*>& src, CopyHelper* helper, float* out,
                  float* lse) {
  const AttentionShape& shape = plan.shape;
  auto spans = PairRows(plan.want.segments, src, shape, plan.unit_len, plan.k_start, plan.valid);
  if (!spans.ok()) return spans.status();
  if (plan.q_rows != nullptr) {  // A sequence without real query rows reads no key.
    spans->erase(std::remove_if(spans->begin(), spans->end(),
                                [&](const KeySpan& s) { return plan.q_rows[s.batch] == 0; }),
                 spans->end());
  }
  AttentionPartial here(shape), there(shape);
  uint64_t rows = 0;
  for (const KeySpan& s : *spans) rows += s.rows;
  std::vector<KeySpan> mine, theirs;
  // Two threads, as for a copy of the same bytes (split_read_bytes of K and V).
  const bool split =
      helper != nullptr && split_bytes > 0 && 2 * rows * shape.row_bytes() >= split_bytes;
  if (split) SplitSpans(*spans, shape.row_bytes(), &mine, &theirs);
  const bool helped = split && helper->TryStart([&] {
    for (const KeySpan& s : theirs) there.Attend(queries, plan.q_start, plan.q_rows, s);
  });
  for (const KeySpan& s : helped ? mine : *spans) here.Attend(queries, plan.q_start, plan.q_rows, s);
  if (helped) {
    helper->Join();
    here.MergeFrom(there);
  }
  here.Finish(out, lse);
  return Status::Ok();
}

ffi::Error AttendImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> segments,
                      ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> tag,
                      ffi::Buffer<ffi::S32> owner, ffi::Buffer<ffi::S32> target,
                      ffi::RemainingArgs /*deps*/, ffi::Result<ffi::Buffer<ffi::F32>> out,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse, int64_t region_base,
                      int64_t region_bytes, int64_t region_count, int32_t region_block_rows,
                      int64_t unit_len, int32_t kv_dtype, int32_t tier_dtype,
                      int32_t num_kv_heads, float scale, float soft_cap, int32_t window) {
  auto op = Bind(target);
  if (!op.ok()) return ToFfiError(op.status());
  Engine& engine = *op->engine;
  StatusOr<int64_t> stream = CheckOwner(engine, owner);
  if (!stream.ok()) return ToFfiError(stream.status());
  auto plan = PlanAttend(*op, *stream, q, segments, positions, tag,
                         MakeRegions(region_base, region_bytes, region_count, region_block_rows),
                         unit_len, kv_dtype, tier_dtype, num_kv_heads, scale, soft_cap, window);
  if (!plan.ok()) return ToFfiError(plan.status());
  const uint64_t split_bytes = engine.options().split_read_bytes;
  Status status = engine.ReadInPlace(
      plan->want, [&](const std::vector<const uint8_t*>& src, CopyHelper* helper) {
        return AttendRows(*plan, q.typed_data(), split_bytes, src, helper, out->typed_data(),
                          lse->typed_data());
      });
  return ToFfiError(status);
}

ffi::Error AttendLandedImpl(ffi::Buffer<ffi::F32> q, ffi::BufferR0<ffi::S32> ticket,
                            ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::S32> positions,
                            ffi::Buffer<ffi::S32> tag, ffi::Buffer<ffi::S32> owner,
                            ffi::Buffer<ffi::S32> target, ffi::RemainingArgs /*deps*/,
                            ffi::Result<ffi::Buffer<ffi::F32>> out,
                            ffi::Result<ffi::Buffer<ffi::F32>> lse, int64_t region_base,
                            int64_t region_bytes, int64_t region_count,
                            int32_t region_block_rows, int64_t unit_len, int32_t kv_dtype,
                            int32_t tier_dtype, int32_t num_kv_heads, float scale,
                            float soft_cap, int32_t window) {
  auto op = Bind(target);
  if (!op.ok()) return ToFfiError(op.status());
  Engine& engine = *op->engine;
  StatusOr<int64_t> stream = CheckOwner(engine, owner);
  if (!stream.ok()) return ToFfiError(stream.status());
  auto plan = PlanAttend(*op, *stream, q, segments, positions, tag,
                         MakeRegions(region_base, region_bytes, region_count, region_block_rows),
                         unit_len, kv_dtype, tier_dtype, num_kv_heads, scale, soft_cap, window);
  if (!plan.ok()) {
    // The ticket is this op's to consume: a refused op leaves no fetch behind it.
    if (ticket.typed_data()[0] != kNoTicket) engine.Discard(ticket.typed_data()[0]);
    return ToFfiError(plan.status());
  }
  const uint64_t split_bytes = engine.options().split_read_bytes;
  bool hit = false;
  Status status = engine.VisitLanded(
      ticket.typed_data()[0], plan->want,
      [&](const std::vector<const uint8_t*>& src, CopyHelper* helper) {
        return AttendRows(*plan, q.typed_data(), split_bytes, src, helper, out->typed_data(),
                          lse->typed_data());
      },
      &hit);
  return ToFfiError(status);
}

ffi::Error AttendSpilledImpl(ffi::Buffer<ffi::F32> q, ffi::BufferR0<ffi::S32> spill_ticket,
                             ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::S32> spill_segments,
                             ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> tag,
                             ffi::Buffer<ffi::S32> owner, ffi::Buffer<ffi::S32> target,
                             ffi::Buffer<ffi::S32> spill_target, ffi::RemainingArgs /*deps*/,
                             ffi::Result<ffi::Buffer<ffi::F32>> out,
                             ffi::Result<ffi::Buffer<ffi::F32>> lse, int64_t region_base,
                             int64_t region_bytes, int64_t region_count,
                             int32_t region_block_rows, int64_t spill_region_base,
                             int64_t spill_region_bytes, int64_t spill_region_count,
                             int32_t spill_region_block_rows, int64_t unit_len,
                             int32_t kv_dtype, int32_t tier_dtype, int32_t num_kv_heads,
                             float scale, float soft_cap, int32_t window) {
  const Ticket ticket = spill_ticket.typed_data()[0];
  auto op = Bind(target);
  if (!op.ok()) return ToFfiError(op.status());
  auto spill = Bind(spill_target);
  if (!spill.ok()) return ToFfiError(spill.status());
  Engine& engine = *op->engine;
  if (spill->engine.get() != &engine) {
    return ToFfiError(InvalidArgument("target and spill_target name different engines"));
  }
  StatusOr<int64_t> stream = CheckOwner(engine, owner);
  if (!stream.ok()) return ToFfiError(stream.status());
  auto plan = PlanAttend(*op, *stream, q, segments, positions, tag,
                         MakeRegions(region_base, region_bytes, region_count, region_block_rows),
                         unit_len, kv_dtype, tier_dtype, num_kv_heads, scale, soft_cap, window);
  StatusOr<FetchRequest> spilled = InvalidArgument("not decoded");
  if (plan.ok()) {
    const uint64_t buffer =
        2 * static_cast<uint64_t>(plan->shape.batch) * unit_len * plan->shape.row_bytes();
    spilled = DecodeFetch(*spill, spill_segments, buffer, tag,
                          MakeRegions(spill_region_base, spill_region_bytes, spill_region_count,
                                      spill_region_block_rows),
                          *stream);
  }
  if (!plan.ok() || !spilled.ok()) {
    if (ticket != kNoTicket) engine.Discard(ticket);  // Nobody else will consume it.
    return ToFfiError(plan.ok() ? spilled.status() : plan.status());
  }
  // The unit's rows on both tiers, attended together: the spill tier's where its fetch
  // landed (held until the attention ends), the memory tier's where they lie (ordered after
  // earlier write-backs of them). Each sequence's rows, both tiers together, must be
  // exactly its valid keys.
  const uint64_t split_bytes = engine.options().split_read_bytes;
  bool hit = false;
  Status status = engine.VisitLanded(
      ticket, *spilled,
      [&](const std::vector<const uint8_t*>& spill_src, CopyHelper*) {
        return engine.ReadInPlace(
            plan->want, [&](const std::vector<const uint8_t*>& src, CopyHelper* helper) {
              AttendPlan both = *plan;
              std::vector<const uint8_t*> rows = src;
              both.want.segments.insert(both.want.segments.end(), spilled->segments.begin(),
                                        spilled->segments.end());
              rows.insert(rows.end(), spill_src.begin(), spill_src.end());
              return AttendRows(both, q.typed_data(), split_bytes, rows, helper,
                                out->typed_data(), lse->typed_data());
            });
      },
      &hit);
  return ToFfiError(status);
}

}  // namespace

// The signatures, operand by operand, are in xla/op_signatures.h (shared with CUDA).
XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncStartCpu, StartImpl, StartSignature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncWaitCpu, WaitImpl, WaitSignature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncWriteBackCpu, WriteBackImpl,
                              WriteBackSignature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncMarkCpu, MarkImpl, MarkSignature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncAttendCpu, AttendImpl, AttendSignature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncAttendLandedCpu, AttendLandedImpl,
                              AttendLandedSignature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncAttendSpilledCpu, AttendSpilledImpl,
                              AttendSpilledSignature(ffi::Ffi::Bind()));

}  // namespace tpusync
