// The mount table of a process's mount namespace, as the kernel shows it in
// /proc/PID/mountinfo.
#pragma once

#include <cstdint>

namespace dsec {

// Mounts in the mount namespace of process `pid` (0: ours): the lines of its
// /proc/PID/mountinfo. -1 when that file cannot be read (the process is gone,
// or no /proc). Thread-safe; reads the whole table (O(mounts)).
int64_t mountCount(int pid = 0);

}  // namespace dsec
