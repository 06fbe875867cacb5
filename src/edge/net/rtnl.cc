#include "edge/net/rtnl.h"

#include <arpa/inet.h>
#include <linux/if_link.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/veth.h>
#include <net/if.h>
#include <sched.h>
#include <sys/socket.h>

#include <cstring>
#include <memory>
#include <system_error>
#include <thread>

namespace dsec::edge {
namespace {

// Large enough for one dump batch: the kernel sizes dump skbs to at most
// 32 KiB; a truncated read is reported, never parsed.
constexpr size_t kRecvBufBytes = 64 * 1024;

size_t align4(size_t n) { return (n + 3) & ~size_t{3}; }

Status checkIfname(const std::string& name) {
  // The kernel's dev_valid_name(), checked here so the error names the field.
  if (name.empty() || name.size() >= IFNAMSIZ || name == "." || name == ".." ||
      name.find_first_of("/: \t\n\v\f\r") != std::string::npos) {
    return invalidArg("ifname", "invalid interface name \"" + name + "\"");
  }
  return Status::ok();
}

// Calls f(type, payload, len) for each attribute in [p, end).
template <typename F>
void forEachAttr(const char* p, const char* end, F&& f) {
  while (end - p >= NLA_HDRLEN) {
    nlattr a;
    memcpy(&a, p, sizeof a);
    if (a.nla_len < NLA_HDRLEN || a.nla_len > end - p) break;
    f(a.nla_type & NLA_TYPE_MASK, p + NLA_HDRLEN, size_t(a.nla_len - NLA_HDRLEN));
    p += align4(a.nla_len);
  }
}

std::string ipv4(uint32_t addr) {
  char buf[INET_ADDRSTRLEN];
  return ::inet_ntop(AF_INET, &addr, buf, sizeof buf) ? buf : "?";
}

std::string attrString(const char* p, size_t len) { return std::string(p, strnlen(p, len)); }

// The kernel's extended-ack message of an NLMSG_ERROR, "" when none.
std::string extackMessage(const nlmsghdr& h) {
  if (!(h.nlmsg_flags & NLM_F_ACK_TLVS)) return {};
  const char* start = reinterpret_cast<const char*>(NLMSG_DATA(&h));
  const auto* e = reinterpret_cast<const nlmsgerr*>(start);
  size_t off = sizeof(nlmsgerr);
  if (!(h.nlmsg_flags & NLM_F_CAPPED)) off += align4(e->msg.nlmsg_len - NLMSG_HDRLEN);
  const char* end = reinterpret_cast<const char*>(&h) + h.nlmsg_len;
  std::string msg;
  if (start + off >= end) return msg;
  forEachAttr(start + off, end, [&](int type, const char* p, size_t len) {
    if (type == NLMSGERR_ATTR_MSG) msg = attrString(p, len);
  });
  return msg;
}

Status nlError(const std::string& what, int err, const std::string& extack) {
  std::string w = extack.empty() ? what : what + " (" + extack + ")";
  // sysError() files ENODEV under kInternal; a missing link is kNotFound.
  if (err == ENODEV) return Status(Code::kNotFound, w + ": " + strerror(err), err);
  return sysError(w, err);
}

Link parseLink(const nlmsghdr& h) {
  Link link;
  if (h.nlmsg_len < NLMSG_LENGTH(sizeof(ifinfomsg))) return link;
  const auto* ifi = reinterpret_cast<const ifinfomsg*>(NLMSG_DATA(&h));
  link.ifindex = ifi->ifi_index;
  const char* p = reinterpret_cast<const char*>(ifi) + NLMSG_ALIGN(sizeof(ifinfomsg));
  const char* end = reinterpret_cast<const char*>(&h) + h.nlmsg_len;
  forEachAttr(p, end, [&](int type, const char* v, size_t len) {
    if (type == IFLA_IFNAME) link.name = attrString(v, len);
    if (type == IFLA_IFALIAS) link.alias = attrString(v, len);
  });
  return link;
}

}  // namespace

// One netlink request: nlmsghdr, the family header, then attributes, each
// padded to 4 bytes as the protocol wants. Nests are patched on end().
class Rtnl::Request {
 public:
  Request(uint16_t type, uint16_t flags) {
    nlmsghdr h{};
    h.nlmsg_type = type;
    h.nlmsg_flags = NLM_F_REQUEST | flags;
    append(&h, sizeof h);
  }
  template <typename T>
  void header(const T& t) {
    append(&t, sizeof t);
  }
  void attr(uint16_t type, const void* data, size_t len) {
    nlattr a{};
    a.nla_type = type;
    a.nla_len = uint16_t(NLA_HDRLEN + len);
    append(&a, sizeof a);
    append(data, len);
  }
  void attr(uint16_t type, const std::string& s) { attr(type, s.c_str(), s.size() + 1); }
  void attrU32(uint16_t type, uint32_t v) { attr(type, &v, sizeof v); }
  size_t beginNest(uint16_t type) {
    size_t off = buf_.size();
    attr(type, nullptr, 0);
    return off;
  }
  void endNest(size_t off) {
    auto len = uint16_t(buf_.size() - off);
    memcpy(buf_.data() + off + offsetof(nlattr, nla_len), &len, sizeof len);
  }
  void seal(uint32_t seq) {
    auto* h = reinterpret_cast<nlmsghdr*>(buf_.data());
    h->nlmsg_len = uint32_t(buf_.size());
    h->nlmsg_seq = seq;
  }
  bool isDump() const {
    return reinterpret_cast<const nlmsghdr*>(buf_.data())->nlmsg_flags & NLM_F_DUMP;
  }
  const char* data() const { return buf_.data(); }
  size_t size() const { return buf_.size(); }

 private:
  void append(const void* p, size_t n) {
    if (n) buf_.insert(buf_.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
    buf_.resize(align4(buf_.size()));
  }
  std::vector<char> buf_;
};

Result<Rtnl> Rtnl::openHere() {
  UniqueFd fd(::socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE));
  if (!fd) return sysError("socket(AF_NETLINK, NETLINK_ROUTE)");
  // Extended acks carry the kernel's reason in words; capped acks leave out the
  // echo of our request. Both are optional (Linux 4.12+ and 4.3+).
  int one = 1;
  (void)::setsockopt(fd.get(), SOL_NETLINK, NETLINK_EXT_ACK, &one, sizeof one);
  (void)::setsockopt(fd.get(), SOL_NETLINK, NETLINK_CAP_ACK, &one, sizeof one);
  return Rtnl(std::move(fd));
}

Result<Rtnl> Rtnl::open(int netnsFd) {
  if (netnsFd < 0) return openHere();
  Result<Rtnl> result = internalError("netns thread did not run");
  try {
    std::thread([&] {
      // Only this thread moves; it exits right after, and the socket keeps
      // its netns.
      if (::setns(netnsFd, CLONE_NEWNET) != 0) {
        result = sysError("setns(CLONE_NEWNET)");
        return;
      }
      result = openHere();
    }).join();
  } catch (const std::system_error& e) {
    return sysError("start a thread to enter the netns", e.code().value());
  }
  return result;
}

Status Rtnl::exchange(Request& req, const std::string& what,
                      const std::function<void(const nlmsghdr&)>& onReply) {
  const uint32_t seq = ++seq_;
  req.seal(seq);
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  ssize_t n;
  do {
    n = ::sendto(fd_.get(), req.data(), req.size(), 0, reinterpret_cast<sockaddr*>(&kernel),
                 sizeof kernel);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return sysError("netlink send (" + what + ")");

  const bool dump = req.isDump();
  auto buf = std::make_unique_for_overwrite<char[]>(kRecvBufBytes);
  for (;;) {
    sockaddr_nl from{};
    iovec iov{buf.get(), kRecvBufBytes};
    msghdr mh{};
    mh.msg_name = &from;
    mh.msg_namelen = sizeof from;
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    ssize_t len;
    do {
      len = ::recvmsg(fd_.get(), &mh, 0);
    } while (len < 0 && errno == EINTR);
    if (len < 0) return sysError("netlink receive (" + what + ")");
    if (mh.msg_flags & MSG_TRUNC) return internalError("netlink reply truncated (" + what + ")");
    if (from.nl_pid != 0) continue;  // not from the kernel

    const char* p = buf.get();
    const char* end = p + len;
    while (end - p >= ssize_t(NLMSG_HDRLEN)) {
      const auto& h = *reinterpret_cast<const nlmsghdr*>(p);
      if (h.nlmsg_len < NLMSG_HDRLEN || h.nlmsg_len > size_t(end - p)) {
        return internalError("malformed netlink reply (" + what + ")");
      }
      p += NLMSG_ALIGN(h.nlmsg_len);
      if (h.nlmsg_seq != seq) continue;  // a late reply to an abandoned request
      if (h.nlmsg_type == NLMSG_ERROR) {
        if (h.nlmsg_len < NLMSG_LENGTH(sizeof(nlmsgerr))) {
          return internalError("short netlink error (" + what + ")");
        }
        int err = reinterpret_cast<const nlmsgerr*>(NLMSG_DATA(&h))->error;
        return err == 0 ? Status::ok() : nlError(what, -err, extackMessage(h));
      }
      if (h.nlmsg_type == NLMSG_DONE && dump) {
        int err = 0;
        if (h.nlmsg_len >= NLMSG_LENGTH(sizeof err)) memcpy(&err, NLMSG_DATA(&h), sizeof err);
        return err >= 0 ? Status::ok() : nlError(what, -err, {});
      }
      if (onReply) onReply(h);
    }
  }
}

Status Rtnl::createVeth(const std::string& hostName, const std::string& peerName, int peerNetnsFd) {
  RETURN_IF_ERROR(checkIfname(hostName));
  RETURN_IF_ERROR(checkIfname(peerName));
  Request req(RTM_NEWLINK, NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL);
  req.header(ifinfomsg{});
  req.attr(IFLA_IFNAME, hostName);
  size_t info = req.beginNest(IFLA_LINKINFO);
  req.attr(IFLA_INFO_KIND, std::string("veth"));
  size_t data = req.beginNest(IFLA_INFO_DATA);
  size_t peer = req.beginNest(VETH_INFO_PEER);
  req.header(ifinfomsg{});
  req.attr(IFLA_IFNAME, peerName);
  if (peerNetnsFd >= 0) req.attrU32(IFLA_NET_NS_FD, uint32_t(peerNetnsFd));
  req.endNest(peer);
  req.endNest(data);
  req.endNest(info);
  return exchange(req, "create veth " + hostName + " (peer " + peerName + ")");
}

Status Rtnl::setAlias(const std::string& name, const std::string& alias) {
  RETURN_IF_ERROR(checkIfname(name));
  Request req(RTM_SETLINK, NLM_F_ACK);
  req.header(ifinfomsg{});
  req.attr(IFLA_IFNAME, name);
  req.attr(IFLA_IFALIAS, alias.data(), alias.size());
  return exchange(req, "set alias of " + name);
}

Result<int> Rtnl::ifindex(const std::string& name) {
  RETURN_IF_ERROR(checkIfname(name));
  Request req(RTM_GETLINK, NLM_F_ACK);
  req.header(ifinfomsg{});
  req.attr(IFLA_IFNAME, name);
  // Filters the reply down to the basics (no stats, no VF info).
  req.attrU32(IFLA_EXT_MASK, RTEXT_FILTER_SKIP_STATS);
  int index = 0;
  RETURN_IF_ERROR(exchange(req, "look up link " + name, [&](const nlmsghdr& h) {
    if (h.nlmsg_type == RTM_NEWLINK) index = parseLink(h).ifindex;
  }));
  if (index <= 0) return internalError("look up link " + name + ": no link in the reply");
  return index;
}

Status Rtnl::setUp(const std::string& name) {
  RETURN_IF_ERROR(checkIfname(name));
  Request req(RTM_SETLINK, NLM_F_ACK);
  ifinfomsg ifi{};
  ifi.ifi_flags = IFF_UP;
  ifi.ifi_change = IFF_UP;
  req.header(ifi);
  req.attr(IFLA_IFNAME, name);
  return exchange(req, "set link up " + name);
}

Status Rtnl::addAddress4(const std::string& name, uint32_t addr, int prefixLen) {
  if (prefixLen < 0 || prefixLen > 32) {
    return invalidArg("prefix_len", "IPv4 prefix length " + std::to_string(prefixLen));
  }
  ASSIGN_OR_RETURN(int index, ifindex(name));
  Request req(RTM_NEWADDR, NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL);
  ifaddrmsg ifa{};
  ifa.ifa_family = AF_INET;
  ifa.ifa_prefixlen = uint8_t(prefixLen);
  ifa.ifa_scope = RT_SCOPE_UNIVERSE;
  ifa.ifa_index = uint32_t(index);
  req.header(ifa);
  req.attr(IFA_LOCAL, &addr, sizeof addr);
  req.attr(IFA_ADDRESS, &addr, sizeof addr);
  return exchange(req,
                  "add address " + ipv4(addr) + "/" + std::to_string(prefixLen) + " to " + name);
}

Status Rtnl::addDefaultRoute4(uint32_t gateway) {
  Request req(RTM_NEWROUTE, NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL);
  rtmsg rtm{};
  rtm.rtm_family = AF_INET;
  rtm.rtm_table = RT_TABLE_MAIN;
  rtm.rtm_protocol = RTPROT_STATIC;
  rtm.rtm_scope = RT_SCOPE_UNIVERSE;
  rtm.rtm_type = RTN_UNICAST;
  req.header(rtm);
  req.attr(RTA_GATEWAY, &gateway, sizeof gateway);
  return exchange(req, "add default route via " + ipv4(gateway));
}

Status Rtnl::deleteLink(const std::string& name) {
  RETURN_IF_ERROR(checkIfname(name));
  Request req(RTM_DELLINK, NLM_F_ACK);
  req.header(ifinfomsg{});
  req.attr(IFLA_IFNAME, name);
  Status st = exchange(req, "delete link " + name);
  if (st.sysErrno() == ENODEV) return Status::ok();
  return st;
}

Result<std::vector<Link>> Rtnl::listLinks() {
  Request req(RTM_GETLINK, NLM_F_DUMP);
  req.header(ifinfomsg{});
  req.attrU32(IFLA_EXT_MASK, RTEXT_FILTER_SKIP_STATS);
  std::vector<Link> links;
  RETURN_IF_ERROR(exchange(req, "list links", [&](const nlmsghdr& h) {
    if (h.nlmsg_type == RTM_NEWLINK) links.push_back(parseLink(h));
  }));
  return links;
}

Result<std::vector<uint32_t>> Rtnl::listAddresses4() {
  Request req(RTM_GETADDR, NLM_F_DUMP);
  ifaddrmsg ifa{};
  ifa.ifa_family = AF_INET;
  req.header(ifa);
  std::vector<uint32_t> out;
  RETURN_IF_ERROR(exchange(req, "list addresses", [&](const nlmsghdr& h) {
    if (h.nlmsg_type != RTM_NEWADDR || h.nlmsg_len < NLMSG_LENGTH(sizeof(ifaddrmsg))) return;
    const auto* m = reinterpret_cast<const ifaddrmsg*>(NLMSG_DATA(&h));
    if (m->ifa_family != AF_INET) return;
    const char* p = reinterpret_cast<const char*>(m) + NLMSG_ALIGN(sizeof(ifaddrmsg));
    const char* end = reinterpret_cast<const char*>(&h) + h.nlmsg_len;
    forEachAttr(p, end, [&](int type, const char* v, size_t len) {
      if (type == IFA_LOCAL && len >= 4) {
        uint32_t a;
        std::memcpy(&a, v, 4);
        out.push_back(a);
      }
    });
  }));
  return out;
}

}  // namespace dsec::edge
