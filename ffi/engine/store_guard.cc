#include "store_guard.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace tpusync {
namespace {

struct Holder {
  long pid;
  bool write;
};

// Who holds flock locks on the file behind `fd`. The kernel's lock table (/proc/locks)
// records the pid of every holder, readers included, and never goes stale when a holder
// dies, so no pid has to be written into the store itself (a read-only attach could not).
// Lines look like "1: FLOCK  ADVISORY  WRITE 5799 fe:00:2146373 0 EOF"; "->" lines are
// waiters. Some filesystems (btrfs) report another device number in stat than in the lock
// table, so an inode-only match is the fallback.
std::vector<Holder> LockHolders(int fd) {
  std::vector<Holder> exact, by_inode;
  struct stat sb;
  if (fstat(fd, &sb) != 0) return exact;
  std::ifstream locks("/proc/locks");
  std::string line;
  while (std::getline(locks, line)) {
    std::istringstream in(line);
    std::string index, kind, advisory, access, dev_ino;
    long pid = 0;
    if (!(in >> index >> kind)) continue;
    if (kind != "FLOCK") continue;  // Also skips "->" waiter lines.
    if (!(in >> advisory >> access >> pid >> dev_ino)) continue;
    unsigned int major_dev = 0, minor_dev = 0;
    unsigned long long ino = 0;
    if (std::sscanf(dev_ino.c_str(), "%x:%x:%llu", &major_dev, &minor_dev, &ino) != 3) continue;
    if (ino != static_cast<unsigned long long>(sb.st_ino)) continue;
    Holder h{pid, access == "WRITE"};
    by_inode.push_back(h);
    if (major_dev == major(sb.st_dev) && minor_dev == minor(sb.st_dev)) exact.push_back(h);
  }
  return exact.empty() ? by_inode : exact;
}

std::string DescribeHolders(const std::vector<Holder>& holders) {
  if (holders.empty()) return "another open (holder pid unknown: /proc/locks does not list it)";
  std::string out;
  for (size_t i = 0; i < holders.size(); ++i) {
    if (i > 0) out += ", ";
    out += "pid " + std::to_string(holders[i].pid) +
           (holders[i].write ? " (read-write)" : " (read-only)");
  }
  return out;
}

}  // namespace

Status LockStore(int fd, bool shared, const std::string& what) {
  while (flock(fd, (shared ? LOCK_SH : LOCK_EX) | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno != EWOULDBLOCK) return ErrnoStatus("cannot lock " + what, errno);
    return FailedPrecondition(
        what + " is already attached by " + DescribeHolders(LockHolders(fd)) +
        (shared ? "; a read-only attach needs every writer closed"
                : "; a writer needs it to itself: close the other tier, use another name, "
                  "or attach with read_only=True"));
  }
  return Status::Ok();
}

uint64_t MemAvailableBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

bool FreeBytes(const std::string& path, uint64_t* free_bytes) {
  struct statvfs vfs;
  if (statvfs(path.c_str(), &vfs) != 0) return false;
  *free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  return true;
}

Status Preallocate(int fd, uint64_t size, const std::string& fs_path, const std::string& what) {
  struct stat sb;
  if (fstat(fd, &sb) != 0) return ErrnoStatus("cannot stat " + what, errno);
  // What is missing: bytes not yet backed (a re-attached store usually has them all).
  const uint64_t backed = static_cast<uint64_t>(sb.st_blocks) * 512;
  const uint64_t missing = size > backed ? size - backed : 0;
  // Fully backed already (a re-attach): fallocate would only walk every page (on tmpfs,
  // about 50 ms per 256 MiB).
  if (missing == 0 && static_cast<uint64_t>(sb.st_size) >= size) return Status::Ok();
  uint64_t free_bytes = 0;
  const bool known = FreeBytes(fs_path, &free_bytes);
  auto no_space = [&](const std::string& why) {
    return ResourceExhausted("cannot preallocate " + what + " of " + std::to_string(size) +
                             " bytes: " + why + " (" + fs_path + " has " +
                             std::to_string(free_bytes) + " bytes free); free space there " +
                             "or ask for fewer blocks");
  };
  if (known && missing > free_bytes) {
    return no_space(std::to_string(missing) + " more bytes needed");
  }
  int err;
  do {
    err = fallocate(fd, 0, 0, static_cast<off_t>(size)) == 0 ? 0 : errno;
  } while (err == EINTR);
  if (err == 0) return Status::Ok();
  if (err == ENOSPC || err == EDQUOT) return no_space(std::strerror(err));
  if (err != EOPNOTSUPP) {
    return ErrnoStatus("cannot preallocate " + what + " of " + std::to_string(size) + " bytes",
                       err);
  }
  // No preallocation here: size it (sparse), free space checked above.
  if (static_cast<uint64_t>(sb.st_size) < size && ftruncate(fd, static_cast<off_t>(size)) != 0) {
    return ErrnoStatus("cannot size " + what + " to " + std::to_string(size) + " bytes", errno);
  }
  return Status::Ok();
}

}  // namespace tpusync
