// Sockets made inside a sandbox's network namespace, for exposed ports
// (EdgeLink::openPort): the node connects to the sandbox's own loopback, so
// no address but 127.0.0.1 / ::1 of that netns is ever dialled, no egress
// rule is involved, and a sandbox without egress can still expose a port.
//
// A socket stays bound to the netns it was created in, whichever thread uses
// it later: a short-lived thread setns()es there and creates the socket, so
// the calling thread never changes namespace (the pattern of Rtnl::open).
// Entering a netns needs CAP_SYS_ADMIN over it (EPERM otherwise).
//
// Thread-safe; neither function takes ownership of netnsFd.
#pragma once

#include "common/fd.h"
#include "common/status.h"

namespace dsec::edge {

// A stream socket (SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC) of `family`
// (AF_INET, AF_INET6) in the netns `netnsFd` refers to, or in the calling
// thread's netns when netnsFd < 0.
// Errors: sysError("setns(CLONE_NEWNET)") (EPERM: kPermissionDenied; EINVAL:
// not a netns); sysError("socket") (EAFNOSUPPORT when the netns has no
// IPv6); kInternal when no thread could be started.
Result<UniqueFd> socketInNetns(int netnsFd, int family);

// A TCP connection from the netns `netnsFd` (here when < 0) to its own
// 127.0.0.1:port, or to [::1]:port when nothing takes it on IPv4 (refused,
// or no IPv4 loopback). Connected, non-blocking, close-on-exec, TCP_NODELAY.
// Blocks the caller up to timeoutS (both attempts together).
// Errors: kInvalidArgument field "port" (not 1..65535); kUnavailable "nothing
// listens on port P" field "port" (refused on both, or the netns has no
// loopback for the family; errno of the IPv4 attempt); kDeadlineExceeded
// field "port" when an attempt had no answer within the time left (a full
// accept queue); socketInNetns's errors; other connect errors as sysError.
Result<UniqueFd> connectLoopback(int netnsFd, int port, double timeoutS);

}  // namespace dsec::edge
