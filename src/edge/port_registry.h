// The node's book of exposed ports (EdgeLink::openPort / setPorts): per
// sandbox, the exposed set the platform last gave (unknown until it gives
// one: then every (port, gen) is taken on trust) and every connection opened
// to it, under its (port, gen), so that dropping a pair from the set, or the
// sandbox going, cuts them.
//
// A connection is recorded as its descriptor number in this process plus
// the socket's identity (st_dev, st_ino), never as a duplicate: a dup would
// keep the socket open after its holder (the platform's proxy, or the link's
// relay) closed it, and the sandbox would never see the connection end. A
// cut takes a fresh duplicate of the number, checks that it still is the
// same socket (the number may have been closed and reused meanwhile), and
// shuts it down both ways: its holder reads EOF, its writes fail, the
// sandbox reads EOF. So the holder must keep the descriptor at the number
// openPort returned it under (moving it into an Asio socket does) until it
// closes it. An entry whose number no longer holds its socket is dropped.
//
// Thread-safe (one mutex; the syscalls under it are fstat, dup, shutdown,
// close of a dup: none blocks).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/types.h"

namespace dsec::edge {

class PortRegistry {
 public:
  // Connections recorded per sandbox at most (entries whose socket is gone
  // are dropped first).
  static constexpr size_t kMaxPerSandbox = 4096;

  // Whether a connection under (port, gen) may be opened now.
  // kPermissionDenied field "port" when a set is known for the sandbox and
  // the pair is not in it.
  Status check(const std::string& id, int port, uint64_t gen) const;
  // Records the connection open at `fd` (a socket): check() again (a set
  // given meanwhile), then room (kResourceExhausted field "port" with
  // kMaxPerSandbox live connections). On error nothing is recorded and the
  // caller closes the socket.
  Status add(const std::string& id, int port, uint64_t gen, int fd);
  // The sandbox's exposed set now: cuts every recorded connection whose
  // (port, gen) is not in it. Returns how many were cut.
  size_t set(const std::string& id, const std::vector<proto::PortGen>& ports);
  // The sandbox went (destroyed, paused to disk): cuts all its connections
  // and forgets its set. Returns how many were cut.
  size_t forget(const std::string& id);
  // Live connections recorded for the sandbox (gone ones dropped first).
  size_t connections(const std::string& id);

 private:
  struct Conn {
    int port;
    uint64_t gen;
    int fd;
    dev_t dev;
    ino_t ino;
  };
  struct Sandbox {
    std::optional<std::vector<proto::PortGen>> exposed;  // nullopt: not told yet
    std::vector<Conn> conns;
    size_t pruneAt = 64;  // prune when conns reaches this (doubles: amortized)
  };
  static bool allowed(const Sandbox& s, int port, uint64_t gen);
  static bool alive(const Conn& c);
  static void cut(const Conn& c);
  static void pruneLocked(Sandbox& s);

  mutable std::mutex mu_;  // guards sandboxes_
  std::map<std::string, Sandbox> sandboxes_;
};

}  // namespace dsec::edge
