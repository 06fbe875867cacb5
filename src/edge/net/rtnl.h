// A minimal rtnetlink client on a raw AF_NETLINK/NETLINK_ROUTE socket: just
// the link, address and route calls the edge's egress plumbing needs (no
// libnl, no `ip`). A netlink socket stays bound to the network namespace it
// was created in, so an Rtnl opened for a sandbox's netns configures that
// netns from any thread.
//
// Errors: a request the kernel refuses becomes sysError("<what> <ifname>",
// errno), with the kernel's extended-ack text in the message when it gives
// one; ENODEV becomes kNotFound (errno kept). A name that is not a valid
// interface name is kInvalidArgument (field "ifname") before anything is sent.
//
// Not thread-safe: one request at a time per Rtnl (open one per thread, or
// hold a lock).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/status.h"

struct nlmsghdr;

namespace dsec::edge {

struct Link {
  std::string name;
  int ifindex = 0;
  std::string alias;  // IFLA_IFALIAS, "" when unset
};

class Rtnl {
 public:
  // A socket in the calling thread's netns (netnsFd < 0), or in the netns
  // `netnsFd` refers to: a short-lived thread setns()es there and creates the
  // socket, so the calling thread never changes namespace. Needs
  // CAP_SYS_ADMIN over that netns for setns (EPERM otherwise). Does not take
  // ownership of netnsFd.
  static Result<Rtnl> open(int netnsFd = -1);

  Rtnl(Rtnl&&) = default;
  Rtnl& operator=(Rtnl&&) = default;

  // A veth pair: `hostName` in this socket's netns and `peerName` created
  // directly in the netns `peerNetnsFd` (here when < 0), so a peer named
  // "eth0" never clashes with this netns's eth0. Both ends start down.
  // kAlreadyExists (EEXIST) when either name is taken.
  Status createVeth(const std::string& hostName, const std::string& peerName, int peerNetnsFd);
  // IFLA_IFALIAS: at most 255 bytes (ERANGE from the kernel otherwise).
  Status setAlias(const std::string& name, const std::string& alias);
  // kNotFound when no such link.
  Result<int> ifindex(const std::string& name);
  Status setUp(const std::string& name);
  // `addr` in network byte order; the prefix route comes with it once the
  // link is up. kAlreadyExists when the address is already on the link.
  Status addAddress4(const std::string& name, uint32_t addr, int prefixLen);
  // Default route in the main table via `gateway` (network byte order), which
  // must be on a link that is up. kAlreadyExists when there is one already.
  Status addDefaultRoute4(uint32_t gateway);
  // Deletes the link (a veth takes its peer along). A missing link is ok.
  Status deleteLink(const std::string& name);
  // Every link of this netns (an RTM_GETLINK dump).
  Result<std::vector<Link>> listLinks();
  // Every IPv4 address on any link of this netns (network order; an
  // RTM_GETADDR dump).
  Result<std::vector<uint32_t>> listAddresses4();

 private:
  explicit Rtnl(UniqueFd fd) : fd_(std::move(fd)) {}
  static Result<Rtnl> openHere();

  class Request;
  // Sends `req` and reads up to its ACK (or NLMSG_DONE for a dump), handing
  // every other reply message to `onReply` (may be null). Replies to other
  // sequence numbers or from anyone but the kernel are ignored.
  Status exchange(Request& req, const std::string& what,
                  const std::function<void(const nlmsghdr&)>& onReply = {});

  UniqueFd fd_;
  uint32_t seq_ = 0;
};

}  // namespace dsec::edge
