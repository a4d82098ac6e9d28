#include "registry.h"

namespace tpusync {

EngineRegistry& EngineRegistry::Global() {
  static auto* registry = new EngineRegistry();  // Never destroyed: outlives exit handlers.
  return *registry;
}

int64_t EngineRegistry::Add(std::shared_ptr<Engine> engine) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t id = next_id_++;
  engines_[id] = std::move(engine);
  return id;
}

std::shared_ptr<Engine> EngineRegistry::Get(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = engines_.find(id);
  return it == engines_.end() ? nullptr : it->second;
}

std::shared_ptr<Engine> EngineRegistry::Remove(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = engines_.find(id);
  if (it == engines_.end()) return nullptr;
  std::shared_ptr<Engine> engine = std::move(it->second);
  engines_.erase(it);
  return engine;
}

}  // namespace tpusync
