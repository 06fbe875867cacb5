#include "proto/egress.h"

#include <arpa/inet.h>
#include <sys/socket.h>

#include <algorithm>
#include <map>

#include "common/util.h"

namespace dsec::proto {
namespace {

Result<std::vector<PortRange>> parsePorts(const std::string& text, const std::string& entry,
                                          const std::string& field) {
  std::vector<PortRange> out;
  auto bad = [&](const std::string& why) { return invalidArg(field, "'" + entry + "': " + why); };
  auto num = [&](const std::string& s) -> int {
    if (s.empty() || s.size() > 5 || s.find_first_not_of("0123456789") != std::string::npos) {
      return -1;
    }
    int v = std::stoi(s);
    return v >= 1 && v <= 65535 ? v : -1;
  };
  for (auto& part : splitString(text, ',')) {
    size_t dash = part.find('-');
    int lo = num(dash == std::string::npos ? part : part.substr(0, dash));
    int hi = dash == std::string::npos ? lo : num(part.substr(dash + 1));
    if (lo < 0 || hi < 0) return bad("port '" + part + "' is not a number from 1 to 65535");
    if (lo > hi) return bad("port range '" + part + "' is reversed");
    out.push_back({uint16_t(lo), uint16_t(hi)});
  }
  if (out.size() > kMaxPortRanges) {
    return bad("at most " + std::to_string(kMaxPortRanges) + " port ranges");
  }
  return out;
}

bool validHostName(const std::string& h) {
  if (h.empty() || h.size() > 253) return false;
  for (auto& label : splitString(h, '.')) {
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
      return false;
    }
    for (char c : label) {
      if (!isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') return false;
    }
  }
  // All digits and dots would be a malformed IPv4 address, not a name.
  return h.find_first_not_of("0123456789.") != std::string::npos;
}

void maskTo(std::array<uint8_t, 16>& a, int family, int prefixLen) {
  int bytes = family == AF_INET ? 4 : 16;
  for (int i = 0; i < bytes; ++i) {
    int keep = std::clamp(prefixLen - i * 8, 0, 8);
    a[i] &= uint8_t(0xff00 >> keep);
  }
}

bool contains(const EgressRule& outer, const EgressRule& inner) {
  if (outer.family != inner.family || outer.prefixLen > inner.prefixLen) return false;
  auto a = inner.addr;
  maskTo(a, inner.family, outer.prefixLen);
  return a == outer.addr;
}

std::vector<PortRange> mergeRanges(std::vector<PortRange> r) {
  std::sort(r.begin(), r.end(), [](auto& a, auto& b) { return a.lo < b.lo; });
  std::vector<PortRange> out;
  for (auto& x : r) {
    if (!out.empty() && int(x.lo) <= int(out.back().hi) + 1) {
      out.back().hi = std::max(out.back().hi, x.hi);
    } else {
      out.push_back(x);
    }
  }
  return out;
}

}  // namespace

Result<EgressEntry> parseEgressEntry(const std::string& text, const std::string& field) {
  auto bad = [&](const std::string& why) { return invalidArg(field, "'" + text + "': " + why); };
  if (text.empty() || text.size() > 300) return bad("empty or longer than 300 characters");
  EgressEntry e;
  std::string addrPart = text, portPart;
  if (text.front() == '[') {
    size_t close = text.find(']');
    if (close == std::string::npos) return bad("missing ']'");
    addrPart = text.substr(1, close - 1);
    if (close + 1 < text.size()) {
      if (text[close + 1] != ':') return bad("expected ':' after ']'");
      portPart = text.substr(close + 2);
      if (portPart.empty()) return bad("empty port list");
    }
  } else if (std::count(text.begin(), text.end(), ':') == 1) {
    size_t colon = text.find(':');
    addrPart = text.substr(0, colon);
    portPart = text.substr(colon + 1);
    if (portPart.empty()) return bad("empty port list");
  }
  // else: no colon, or a bare IPv6 address (several colons) without ports.
  if (!portPart.empty()) {
    ASSIGN_OR_RETURN(e.ports, parsePorts(portPart, text, field));
  }
  std::string ip = addrPart;
  int prefix = -1;
  if (size_t slash = addrPart.find('/'); slash != std::string::npos) {
    ip = addrPart.substr(0, slash);
    std::string p = addrPart.substr(slash + 1);
    if (p.empty() || p.size() > 3 || p.find_first_not_of("0123456789") != std::string::npos) {
      return bad("prefix length '" + p + "' is not a number");
    }
    prefix = std::stoi(p);
  }
  if (inet_pton(AF_INET, ip.c_str(), e.addr.data()) == 1) {
    e.family = AF_INET;
  } else if (inet_pton(AF_INET6, ip.c_str(), e.addr.data()) == 1) {
    e.family = AF_INET6;
  } else {
    if (prefix >= 0) return bad("a prefix length needs an address, not a host name");
    if (text.front() == '[' || !validHostName(ip)) {
      return bad("not an IPv4/IPv6 address, CIDR or host name");
    }
    e.host = asciiLower(ip);
    return e;
  }
  int maxLen = e.family == AF_INET ? 32 : 128;
  if (prefix > maxLen) return bad("prefix length above " + std::to_string(maxLen));
  e.prefixLen = prefix < 0 ? maxLen : prefix;
  maskTo(e.addr, e.family, e.prefixLen);
  return e;
}

std::string formatEgressEntry(const EgressEntry& e) {
  std::string s;
  if (!e.host.empty()) {
    s = e.host;
  } else {
    char buf[INET6_ADDRSTRLEN] = {};
    inet_ntop(e.family, e.addr.data(), buf, sizeof buf);
    s = buf;
    s += "/" + std::to_string(e.prefixLen);
    if (e.family == AF_INET6 && !e.ports.empty()) s = "[" + s + "]";
  }
  for (size_t i = 0; i < e.ports.size(); ++i) {
    s += i == 0 ? ":" : ",";
    s += std::to_string(e.ports[i].lo);
    if (e.ports[i].hi != e.ports[i].lo) s += "-" + std::to_string(e.ports[i].hi);
  }
  return s;
}

Result<std::vector<EgressRule>> compileEgress(const std::vector<EgressEntry>& entries,
                                              const std::string& field) {
  // One rule per distinct prefix, its own ranges merged.
  std::map<std::tuple<int, std::array<uint8_t, 16>, int>, std::vector<PortRange>> byPrefix;
  for (auto& e : entries) {
    if (!e.host.empty()) {
      return Status(Code::kInternal, "egress entry '" + e.host + "' was not resolved");
    }
    auto& r = byPrefix[{e.family, e.addr, e.prefixLen}];
    if (e.ports.empty()) {
      r.push_back({1, 65535});
    } else {
      r.insert(r.end(), e.ports.begin(), e.ports.end());
    }
  }
  std::vector<EgressRule> own;
  for (auto& [k, ports] : byPrefix) {
    own.push_back({std::get<0>(k), std::get<1>(k), std::get<2>(k), mergeRanges(ports)});
  }
  std::vector<EgressRule> out;
  for (auto& r : own) {
    EgressRule x = r;
    for (auto& o : own) {
      if (&o != &r && contains(o, r)) x.ports.insert(x.ports.end(), o.ports.begin(), o.ports.end());
    }
    x.ports = mergeRanges(x.ports);
    if (x.ports.size() > kMaxPortRanges) {
      return invalidArg(field, formatEgressEntry({"", x.family, x.addr, x.prefixLen, {}}) +
                                   " would need more than " + std::to_string(kMaxPortRanges) +
                                   " port ranges with the entries that contain it");
    }
    out.push_back(std::move(x));
  }
  return out;
}

}  // namespace dsec::proto
