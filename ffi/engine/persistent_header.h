// The 4 KiB header at the start of a persistent tier (shm segment or file). It records the
// layout and the named regions, so that re-attaching with another layout is refused instead
// of silently reinterpreting someone else's bytes.
#ifndef TPUSYNC_ENGINE_PERSISTENT_HEADER_H_
#define TPUSYNC_ENGINE_PERSISTENT_HEADER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tier.h"

namespace tpusync {

inline constexpr uint64_t kHeaderBytes = 4096;
inline constexpr uint32_t kHeaderVersion = 2;
inline constexpr int kMaxRegionNameBytes = 47;

// Serializes layout + regions into exactly kHeaderBytes.
Status EncodeHeader(const TierLayout& layout, const std::vector<NamedRegion>& regions,
                    uint8_t* out);
// Checks magic, version and layout (block_bytes, num_blocks); fills `regions` and
// `alignment_offset` (the stored one wins: it only moves bytes, never changes them).
// `what` names the store in messages.
Status DecodeHeader(const uint8_t* in, const TierLayout& expected, const std::string& what,
                    std::vector<NamedRegion>* regions, uint64_t* alignment_offset);
// True when the bytes are all zero (a freshly created store).
bool HeaderIsBlank(const uint8_t* in);

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_PERSISTENT_HEADER_H_
