// Guards shared by the persistent tiers: exclusive (or shared read-only) ownership of a
// backing store, and sizes checked up front so that running out of memory or disk is an
// error at construction instead of a SIGBUS or an OOM kill on first touch.
#ifndef TPUSYNC_ENGINE_STORE_GUARD_H_
#define TPUSYNC_ENGINE_STORE_GUARD_H_

#include <cstdint>
#include <string>

#include "status.h"

namespace tpusync {

// Takes flock(LOCK_EX | LOCK_NB) on `fd` (LOCK_SH when `shared`), kept until the descriptor
// closes. flock belongs to the open file description, so a second open in the same process
// conflicts too. On conflict: FailedPrecondition naming `what` and the holders' pids.
Status LockStore(int fd, bool shared, const std::string& what);

// MemAvailable from /proc/meminfo in bytes; 0 when it cannot be read (no check then).
uint64_t MemAvailableBytes();

// Free bytes for an unprivileged writer on the filesystem holding `path`; false on error.
bool FreeBytes(const std::string& path, uint64_t* free_bytes);

// Makes `fd` (a fresh or re-attached store) at least `size` bytes, with every byte backed
// by disk or tmpfs pages now. fallocate(mode 0) never changes existing bytes, so it is safe
// on re-attach. Where the filesystem cannot preallocate (EOPNOTSUPP) the file is only sized,
// after checking that `fs_path`'s free space covers what is missing. `what` names the store.
Status Preallocate(int fd, uint64_t size, const std::string& fs_path, const std::string& what);

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_STORE_GUARD_H_
