// cgroup eBPF egress filter for dsec sandboxes (built with clang -target bpf,
// embedded in the edge as a libbpf skeleton; see egress_filter.h).
//
// Attached once to the edge's cgroup v2 parent, so it sees every connect(2)
// and unconnected sendmsg(2) of every sandbox process. A sandbox is found by
// its cgroup id (the current cgroup or an ancestor) in `sandboxes`; its
// allow-list lives in LPM tries keyed by (sandbox cgroup id, address), so one
// program serves all sandboxes and a phase switch is a map update that
// running processes see at their next connect. Anything not found is denied:
// an unknown cgroup, an address not listed, a port outside the entry's ranges.
// The sandbox's own loopback always passes.
//
// A cgroup_skb/egress program checks every packet a sandbox socket sends
// against the same allow-list (destination address and, for TCP and UDP,
// port): a connection opened under one policy carries no more data once a
// switch takes its destination off the list. Drops there are not counted (a
// TCP retransmission would count again); the connect that opened it was.
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#define MAX_RANGES 8
#define MAX_DEPTH 16

struct sandbox {
  __u64 denied;       // connects/sends refused so far
  __u32 last_ip4;     // last refused destination (IPv4, network order; 0 if v6)
  __u32 last_port;    // host order
  __u32 last_ip6[4];  // last refused destination when IPv6
};

struct allow {
  __u16 lo[MAX_RANGES];  // port ranges, host order, inclusive
  __u16 hi[MAX_RANGES];
  __u32 n;
};

struct key4 {
  __u32 prefixlen;  // 64 + mask bits
  __u8 cg[8];
  __u8 addr[4];
};

struct key6 {
  __u32 prefixlen;  // 64 + mask bits
  __u8 cg[8];
  __u8 addr[16];
};

struct {
  __uint(type, BPF_MAP_TYPE_HASH);
  __uint(max_entries, 65536);
  __type(key, __u64);
  __type(value, struct sandbox);
} sandboxes SEC(".maps");

struct {
  __uint(type, BPF_MAP_TYPE_LPM_TRIE);
  __uint(max_entries, 262144);
  __uint(map_flags, BPF_F_NO_PREALLOC);
  __type(key, struct key4);
  __type(value, struct allow);
} allow4 SEC(".maps");

struct {
  __uint(type, BPF_MAP_TYPE_LPM_TRIE);
  __uint(max_entries, 65536);
  __uint(map_flags, BPF_F_NO_PREALLOC);
  __type(key, struct key6);
  __type(value, struct allow);
} allow6 SEC(".maps");

static __always_inline struct sandbox* find_sandbox(__u64* cg) {
  __u64 id = bpf_get_current_cgroup_id();
  struct sandbox* sb = bpf_map_lookup_elem(&sandboxes, &id);
  if (sb) {
    *cg = id;
    return sb;
  }
  // A process in a group below the sandbox's own: try the ancestors.
  for (int level = 1; level < MAX_DEPTH; level++) {
    id = bpf_get_current_ancestor_cgroup_id(level);
    if (id == 0) break;
    sb = bpf_map_lookup_elem(&sandboxes, &id);
    if (sb) {
      *cg = id;
      return sb;
    }
  }
  return 0;
}

// find_sandbox() for a packet: by the cgroup of the socket that sends it
// (the send may run in softirq or timer context, not in the sandbox's task).
static __always_inline __u64 skb_sandbox(struct __sk_buff* skb) {
  __u64 id = bpf_skb_cgroup_id(skb);
  if (bpf_map_lookup_elem(&sandboxes, &id)) return id;
  for (int level = 1; level < MAX_DEPTH; level++) {
    id = bpf_skb_ancestor_cgroup_id(skb, level);
    if (id == 0) break;
    if (bpf_map_lookup_elem(&sandboxes, &id)) return id;
  }
  return 0;
}

static __always_inline int port_ok(const struct allow* a, __u16 port) {
  for (int i = 0; i < MAX_RANGES; i++) {
    if (i >= a->n) break;
    if (port >= a->lo[i] && port <= a->hi[i]) return 1;
  }
  return 0;
}

static __always_inline void put_cg(__u8* dst, __u64 cg) {
  __builtin_memcpy(dst, &cg, 8);
}

static __always_inline int deny(struct sandbox* sb, __u32 ip4, const __u32* ip6, __u16 port) {
  if (sb) {
    __sync_fetch_and_add(&sb->denied, 1);
    sb->last_ip4 = ip4;
    sb->last_port = port;
    if (ip6) {
      sb->last_ip6[0] = ip6[0];
      sb->last_ip6[1] = ip6[1];
      sb->last_ip6[2] = ip6[2];
      sb->last_ip6[3] = ip6[3];
    } else {
      sb->last_ip6[0] = sb->last_ip6[1] = sb->last_ip6[2] = sb->last_ip6[3] = 0;
    }
  }
  return 0;
}

// ip4 in network order; port in host order.
static __always_inline int check4(__u32 ip4, __u16 port) {
  if ((bpf_ntohl(ip4) >> 24) == 127) return 1;  // the sandbox's own loopback
  __u64 cg = 0;
  struct sandbox* sb = find_sandbox(&cg);
  if (!sb) return 0;
  struct key4 k = {.prefixlen = 64 + 32};
  put_cg(k.cg, cg);
  __builtin_memcpy(k.addr, &ip4, 4);
  struct allow* a = bpf_map_lookup_elem(&allow4, &k);
  if (a && port_ok(a, port)) return 1;
  return deny(sb, ip4, 0, port);
}

static __always_inline int check6(struct bpf_sock_addr* ctx) {
  __u32 ip6[4];
  ip6[0] = ctx->user_ip6[0];
  ip6[1] = ctx->user_ip6[1];
  ip6[2] = ctx->user_ip6[2];
  ip6[3] = ctx->user_ip6[3];
  __u16 port = bpf_ntohs((__u16)ctx->user_port);
  // An IPv4-mapped address (::ffff:a.b.c.d) is IPv4 on the wire.
  if (ip6[0] == 0 && ip6[1] == 0 && ip6[2] == bpf_htonl(0xffff)) return check4(ip6[3], port);
  // ::1, the sandbox's own loopback.
  if (ip6[0] == 0 && ip6[1] == 0 && ip6[2] == 0 && ip6[3] == bpf_htonl(1)) return 1;
  __u64 cg = 0;
  struct sandbox* sb = find_sandbox(&cg);
  if (!sb) return 0;
  struct key6 k = {.prefixlen = 64 + 128};
  put_cg(k.cg, cg);
  __builtin_memcpy(k.addr, ip6, 16);
  struct allow* a = bpf_map_lookup_elem(&allow6, &k);
  if (a && port_ok(a, port)) return 1;
  return deny(sb, 0, ip6, port);
}

SEC("cgroup/connect4")
int dsec_connect4(struct bpf_sock_addr* ctx) {
  return check4(ctx->user_ip4, bpf_ntohs((__u16)ctx->user_port));
}

SEC("cgroup/sendmsg4")
int dsec_sendmsg4(struct bpf_sock_addr* ctx) {
  return check4(ctx->user_ip4, bpf_ntohs((__u16)ctx->user_port));
}

SEC("cgroup/connect6")
int dsec_connect6(struct bpf_sock_addr* ctx) { return check6(ctx); }

SEC("cgroup/sendmsg6")
int dsec_sendmsg6(struct bpf_sock_addr* ctx) { return check6(ctx); }

SEC("cgroup_skb/egress")
int dsec_skb_egress(struct __sk_buff* skb) {
  if (skb->protocol == bpf_htons(ETH_P_IP)) {
    struct iphdr ip;
    if (bpf_skb_load_bytes(skb, 0, &ip, sizeof ip) < 0) return 0;
    if ((bpf_ntohl(ip.daddr) >> 24) == 127) return 1;
    __u64 cg = skb_sandbox(skb);
    if (!cg) return 0;
    struct key4 k = {.prefixlen = 64 + 32};
    put_cg(k.cg, cg);
    __builtin_memcpy(k.addr, &ip.daddr, 4);
    struct allow* a = bpf_map_lookup_elem(&allow4, &k);
    if (!a) return 0;
    // A later fragment has no ports: the address decides.
    if (ip.frag_off & bpf_htons(0x1fff)) return 1;
    if (ip.protocol != IPPROTO_TCP && ip.protocol != IPPROTO_UDP) return 0;
    __u16 dport;
    if (bpf_skb_load_bytes(skb, ip.ihl * 4 + 2, &dport, 2) < 0) return 0;
    return port_ok(a, bpf_ntohs(dport));
  }
  if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
    struct ipv6hdr ip6;
    if (bpf_skb_load_bytes(skb, 0, &ip6, sizeof ip6) < 0) return 0;
    __u32 d[4];
    __builtin_memcpy(d, &ip6.daddr, 16);
    if (d[0] == 0 && d[1] == 0 && d[2] == 0 && d[3] == bpf_htonl(1)) return 1;
    __u64 cg = skb_sandbox(skb);
    if (!cg) return 0;
    struct key6 k = {.prefixlen = 64 + 128};
    put_cg(k.cg, cg);
    __builtin_memcpy(k.addr, d, 16);
    struct allow* a = bpf_map_lookup_elem(&allow6, &k);
    if (!a) return 0;
    // Extension headers are not walked: only plain TCP and UDP pass.
    if (ip6.nexthdr != IPPROTO_TCP && ip6.nexthdr != IPPROTO_UDP) return 0;
    __u16 dport;
    if (bpf_skb_load_bytes(skb, sizeof ip6 + 2, &dport, 2) < 0) return 0;
    return port_ok(a, bpf_ntohs(dport));
  }
  return 0;
}

char LICENSE[] SEC("license") = "GPL";
