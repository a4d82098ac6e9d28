// Engines by id. XLA custom calls name their engine by an integer attribute; the registry
// turns it into a shared_ptr that keeps the engine alive for the duration of the call.
#ifndef TPUSYNC_ENGINE_REGISTRY_H_
#define TPUSYNC_ENGINE_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "engine.h"

namespace tpusync {

class EngineRegistry {
 public:
  static EngineRegistry& Global();

  int64_t Add(std::shared_ptr<Engine> engine);
  // Null when the id is unknown or the engine was removed.
  std::shared_ptr<Engine> Get(int64_t id);
  std::shared_ptr<Engine> Remove(int64_t id);

 private:
  std::mutex mu_;
  int64_t next_id_ = 1;
  std::unordered_map<int64_t, std::shared_ptr<Engine>> engines_;
};

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_REGISTRY_H_
