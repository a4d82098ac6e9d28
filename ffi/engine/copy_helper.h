// A thread that copies one caller's share of a memory tier's read while the caller copies
// the rest. Such a read runs inside the wait of the op that needs it, so the compute is
// stopped meanwhile and the machine's other cores idle; two threads move DRAM to DRAM
// faster than one.

#ifndef TPUSYNC_ENGINE_COPY_HELPER_H_
#define TPUSYNC_ENGINE_COPY_HELPER_H_

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace tpusync {

// Pins the calling thread to `cpu` (the engine's workers and its copy helper).
void PinThisThread(int cpu);

class CopyHelper {
 public:
  // Pinned to `cpu` (< 0: not pinned).
  explicit CopyHelper(int cpu);
  ~CopyHelper();  // Joins the thread; a started task runs to its end first.
  CopyHelper(const CopyHelper&) = delete;
  CopyHelper& operator=(const CopyHelper&) = delete;

  // Starts `task` on the helper's thread and returns true, or returns false (nothing
  // started) while another caller's task holds the helper. After true, call Join().
  bool TryStart(std::function<void()> task);
  // Blocks until the started task returned; frees the helper for the next caller.
  void Join();

 private:
  void Loop(int cpu);

  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> task_;  // Set: to run, or running.
  bool claimed_ = false;        // A caller started a task and has not joined it yet.
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_COPY_HELPER_H_
