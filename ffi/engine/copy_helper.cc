#include "copy_helper.h"

#include <pthread.h>
#include <sched.h>

#include <utility>

namespace tpusync {

void PinThisThread(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

CopyHelper::CopyHelper(int cpu) : thread_([this, cpu] { Loop(cpu); }) {}

CopyHelper::~CopyHelper() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool CopyHelper::TryStart(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (claimed_ || stop_) return false;
    claimed_ = true;
    task_ = std::move(task);
  }
  cv_.notify_all();
  return true;
}

void CopyHelper::Join() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !task_; });
  claimed_ = false;
}

void CopyHelper::Loop(int cpu) {
  if (cpu >= 0) PinThisThread(cpu);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || task_; });
    if (task_) {  // Runs a started task even when stopping: its caller is in Join().
      std::function<void()> task = task_;
      lock.unlock();
      task();
      lock.lock();
      task_ = nullptr;
      cv_.notify_all();
      continue;
    }
    return;
  }
}

}  // namespace tpusync
