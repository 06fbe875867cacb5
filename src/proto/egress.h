// Egress allow-list entries of a policy, parsed and compiled into the rules
// a node's eBPF filter (edge/net/egress_filter.h) matches: egress rules as
// data. Pure functions, no kernel calls.
//
// An entry is an address or a host name, optionally with ports:
//   "10.1.2.3"  "10.0.0.0/8"  "10.0.0.0/8:80"  "10.1.2.3:80,443,8000-8100"
//   "2001:db8::/32"  "[2001:db8::1]:443"  "deb.debian.org:80"
// No port means every port. Host names are resolved by the caller (the
// platform) to addresses before compile().
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/types.h"

namespace dsec::proto {

// At most this many port ranges per address entry (the filter's map value).
inline constexpr size_t kMaxPortRanges = 8;

struct EgressEntry {
  std::string host;  // a name to resolve; empty when addr is set
  int family = 0;    // AF_INET or AF_INET6 when host is empty
  std::array<uint8_t, 16> addr{};
  int prefixLen = 0;
  std::vector<PortRange> ports;  // empty: all
};

// kInvalidArgument naming `field` for anything malformed (bad address, prefix
// longer than the family allows, port 0 or > 65535, lo > hi, too many ranges).
Result<EgressEntry> parseEgressEntry(const std::string& text, const std::string& field);

// Canonical text of an address entry ("10.0.0.0/8:80,443"), as the API shows it.
std::string formatEgressEntry(const EgressEntry& e);

// Rules (proto::EgressRule) are what a node's filter stores: one per distinct
// (family, masked prefix), with the port ranges that apply there. Since the
// filter takes the longest matching prefix only, each rule also carries the
// ranges of every shorter prefix that contains it, so that a more specific
// entry never narrows a broader one.
//
// `entries` must all be addresses (host names resolved). kInvalidArgument
// naming `field` when a rule would need more than kMaxPortRanges ranges.
Result<std::vector<EgressRule>> compileEgress(const std::vector<EgressEntry>& entries,
                                              const std::string& field);

}  // namespace dsec::proto
