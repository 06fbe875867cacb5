// Helpers shared by the network tests: addresses, threads inside a netns,
// throwaway network namespaces. Test-only.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <thread>

#include "common/fd.h"

namespace dsec::edge::testing {

// A dotted IPv4 address in network order.
inline uint32_t ip(const char* s) {
  in_addr a{};
  inet_pton(AF_INET, s, &a);
  return a.s_addr;
}

// Runs fn on a thread inside the netns `nsFd`; the calling thread stays put.
inline void runIn(int nsFd, const std::function<void()>& fn) {
  std::thread([&] {
    ASSERT_EQ(setns(nsFd, CLONE_NEWNET), 0) << strerror(errno);
    fn();
  }).join();
}

// A new, empty netns, held by the returned fd only (the thread that made it
// exits).
inline UniqueFd newNetns() {
  UniqueFd fd;
  std::thread([&] {
    if (unshare(CLONE_NEWNET) == 0) {
      fd.reset(open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
    }
  }).join();
  return fd;
}

}  // namespace dsec::edge::testing
