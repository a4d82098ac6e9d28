// Attention over KV rows where they lie in host memory (a memory tier's pool), for the CPU
// backend: a host-tier unit is attended to without being copied into an XLA buffer first.
//
// A memory tier's read can only run inside the op that needs its bytes (an operand is
// ours only while that op runs), so the copy stops the compute it should overlap. Reading
// the pool in place removes the copy, and with it every byte the copy wrote and the
// attention read back.
//
// The numbers match kernels/reference.py's chunk_attention_reference (f32 arithmetic,
// causal and sliding-window masks, soft cap, grouped-query heads), up to summation order.
//
// Rows are bf16 or f32 values, or quantized (jax_tpusync/core/quantize.py): per row
// [num_kv_heads * head_dim one-byte codes][num_kv_heads f32 scales][zero padding to 16
// bytes], codes int8 or float8_e4m3fn. The scales are applied inside the attention, as the
// reference's k_scale/v_scale are: logits (q . codes_k) * s_k, and the weights times s_v
// when they accumulate codes_v (the softmax's sum unscaled); no row is dequantized.

#ifndef TPUSYNC_ENGINE_POOL_ATTENTION_H_
#define TPUSYNC_ENGINE_POOL_ATTENTION_H_

#include <cstdint>
#include <vector>

#include "status.h"

namespace tpusync {

enum class KvDtype : int32_t { kFloat32 = 0, kBfloat16 = 1 };

// What a row holds: kNone, values of the KvDtype; else one-byte codes of this type and
// per-(token, head) f32 scales (the KvDtype is then the cache's, and no byte of the row).
enum class TierDtype : int32_t { kNone = 0, kInt8 = 1, kFloat8E4M3 = 2 };

// Bytes of one quantized row (codes, scales, padding to 16 bytes), as quantize.row_bytes.
uint64_t QuantizedRowBytes(int32_t num_kv_heads, int32_t head_dim);

struct AttentionShape {
  int32_t batch = 0;
  int32_t q_len = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  KvDtype kv_dtype = KvDtype::kFloat32;
  TierDtype tier_dtype = TierDtype::kNone;
  float scale = 1.0f;
  float soft_cap = 0.0f;  // <= 0: none.
  int32_t window = 0;     // <= 0: none (full causal attention).

  bool quantized() const { return tier_dtype != TierDtype::kNone; }
  uint64_t row_bytes() const;  // One token's K (or V) row: all kv heads.
  Status Check() const;
};

// `rows` consecutive keys of sequence `batch`, the first at absolute position `position`:
// K row i at k + i * row_bytes, V row i at v + i * row_bytes.
struct KeySpan {
  int32_t batch = 0;
  int32_t position = 0;
  int32_t rows = 0;
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
};

// The build of the inner loops this CPU runs: "avx512" (AVX-512F, with AVX2, FMA and
// F16C), "avx2" (AVX2 with FMA and F16C) or "baseline".
const char* PoolAttentionIsa();

// Cuts `spans` into two lists of (about) equal rows, cutting at most one span, for two
// threads. Either list may be empty.
void SplitSpans(const std::vector<KeySpan>& spans, uint64_t row_bytes,
                std::vector<KeySpan>* first, std::vector<KeySpan>* second);

// The online-softmax state of every (sequence, query, query head) over the keys seen so
// far: the unnormalized weighted sum of values, the running max and the sum of weights.
class AttentionPartial {
 public:
  explicit AttentionPartial(const AttentionShape& shape);

  // Attends the queries q (f32[batch, q_len, num_q_heads, head_dim]; query t of sequence b
  // at absolute position q_start[b] + t) to the span's visible keys. Only sequence b's
  // first q_rows[b] queries attend (clamped to [0, q_len]; q_rows null: all q_len): the
  // others are a step's padding rows, which cost nothing and see no key (out 0, lse -inf).
  void Attend(const float* q, const int32_t* q_start, const int32_t* q_rows,
              const KeySpan& span);
  // Folds in another partial over a disjoint set of keys.
  void MergeFrom(const AttentionPartial& other);
  // out f32[batch, q_len, num_q_heads, head_dim] (normalized), lse f32[batch, q_len,
  // num_q_heads]; a query that saw no key gets out = 0 and lse = -inf.
  void Finish(float* out, float* lse) const;

 private:
  AttentionShape shape_;
  std::vector<float> acc_;  // [batch, q_len, num_q_heads, head_dim]
  std::vector<float> max_;  // [batch, q_len, num_q_heads]
  std::vector<float> sum_;  // [batch, q_len, num_q_heads]
};

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_POOL_ATTENTION_H_
