#include "aether/users.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>

#include "common/fd.h"

namespace dsec::aether {

namespace {

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    if (pos == std::string_view::npos) {
      parts.push_back(s.substr(start));
      return parts;
    }
    parts.push_back(s.substr(start, pos - start));
    start = pos + 1;
  }
}

// Ids are decimal numbers below 2^32-1 ((uid_t)-1 means "unchanged" to setuid).
bool parseId(std::string_view s, uint32_t& out) {
  if (s.empty() || s.size() > 10) return false;
  uint64_t v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || v >= 0xffffffffull) return false;
  out = static_cast<uint32_t>(v);
  return true;
}

template <typename Fn>
void forEachLine(std::string_view text, Fn fn) {
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || line[0] == '#' || line[0] == '+' || line[0] == '-') continue;
    fn(line);
  }
}

}  // namespace

std::vector<PasswdEntry> parsePasswd(std::string_view text) {
  std::vector<PasswdEntry> out;
  forEachLine(text, [&](std::string_view line) {
    auto f = split(line, ':');
    if (f.size() != 7 || f[0].empty()) return;
    PasswdEntry e;
    uint32_t uid = 0, gid = 0;
    if (!parseId(f[2], uid) || !parseId(f[3], gid)) return;
    e.name = f[0];
    e.uid = uid;
    e.gid = gid;
    e.home = f[5];
    e.shell = f[6];
    out.push_back(std::move(e));
  });
  return out;
}

std::vector<GroupEntry> parseGroup(std::string_view text) {
  std::vector<GroupEntry> out;
  forEachLine(text, [&](std::string_view line) {
    auto f = split(line, ':');
    if (f.size() != 4 || f[0].empty()) return;
    uint32_t gid = 0;
    if (!parseId(f[2], gid)) return;
    GroupEntry g;
    g.name = f[0];
    g.gid = gid;
    if (!f[3].empty()) {
      for (std::string_view m : split(f[3], ',')) {
        if (!m.empty()) g.members.emplace_back(m);
      }
    }
    out.push_back(std::move(g));
  });
  return out;
}

Result<Credentials> resolveUser(std::string_view spec, std::string_view passwd_text,
                                std::string_view group_text) {
  if (spec.find('\0') != std::string_view::npos) {
    return invalidArg("user", "user must not contain NUL bytes");
  }
  std::string_view user_part = spec;
  std::string_view group_part;
  bool has_group = false;
  if (size_t colon = spec.find(':'); colon != std::string_view::npos) {
    user_part = spec.substr(0, colon);
    group_part = spec.substr(colon + 1);
    has_group = true;
    if (group_part.empty())
      return invalidArg("user", "empty group in user \"" + std::string(spec) + "\"");
  }
  if (user_part.empty()) return invalidArg("user", "empty user");

  std::vector<PasswdEntry> users = parsePasswd(passwd_text);
  const PasswdEntry* entry = nullptr;
  Credentials c;
  uint32_t id = 0;
  if (parseId(user_part, id)) {
    for (const auto& u : users) {
      if (u.uid == id) {
        entry = &u;
        break;
      }
    }
    c.uid = id;
    c.gid = id;
  } else {
    for (const auto& u : users) {
      if (u.name == user_part) {
        entry = &u;
        break;
      }
    }
    if (entry == nullptr && user_part != "root") {
      return invalidArg("user", "unknown user \"" + std::string(user_part) + "\"");
    }
    c.uid = 0;
    c.gid = 0;
  }
  if (entry != nullptr) {
    c.uid = entry->uid;
    c.gid = entry->gid;
    c.home = entry->home;
  }
  if (c.home.empty()) c.home = c.uid == 0 ? "/root" : "/";

  std::vector<GroupEntry> groups = parseGroup(group_text);
  if (has_group) {
    uint32_t gid = 0;
    if (parseId(group_part, gid)) {
      c.gid = gid;
    } else {
      auto it = std::find_if(groups.begin(), groups.end(),
                             [&](const GroupEntry& g) { return g.name == group_part; });
      if (it == groups.end()) {
        return invalidArg("user", "unknown group \"" + std::string(group_part) + "\"");
      }
      c.gid = it->gid;
    }
  }
  c.groups.push_back(c.gid);
  if (entry != nullptr) {
    for (const auto& g : groups) {
      if (std::find(g.members.begin(), g.members.end(), entry->name) != g.members.end() &&
          std::find(c.groups.begin(), c.groups.end(), g.gid) == c.groups.end()) {
        c.groups.push_back(g.gid);
      }
    }
  }
  return c;
}

Result<std::string> readSmallFile(const std::string& path, size_t max_size) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (!fd) {
    if (errno == ENOENT) return std::string();
    return sysError("open " + path);
  }
  // The sandbox owns these files: a FIFO or a device in their place must not
  // hang or flood aether.
  struct stat st;
  if (::fstat(fd.get(), &st) < 0) return sysError("stat " + path);
  if (!S_ISREG(st.st_mode))
    return Status(Code::kFailedPrecondition, path + " is not a regular file");
  std::string out;
  char buf[16384];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return sysError("read " + path);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > max_size) return Status(Code::kResourceExhausted, path + " is too large");
  }
  return out;
}

namespace {

struct Extent {
  uint64_t inside = 0, count = 0;
};

std::vector<Extent> parseIdMap(std::string_view text) {
  std::vector<Extent> out;
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string line(text.substr(0, nl));
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    unsigned long long inside = 0, outside = 0, count = 0;
    if (std::sscanf(line.c_str(), "%llu %llu %llu", &inside, &outside, &count) == 3) {
      out.push_back({inside, count});
    }
  }
  return out;
}

bool mapped(const std::vector<Extent>& map, uint64_t id) {
  if (map.empty()) return true;
  for (const Extent& e : map) {
    if (id >= e.inside && id - e.inside < e.count) return true;
  }
  return false;
}

std::string describe(const std::vector<Extent>& map) {
  std::string out;
  for (const Extent& e : map) {
    if (!out.empty()) out += ", ";
    out += std::to_string(e.inside) + "-" + std::to_string(e.inside + e.count - 1);
  }
  return out;
}

}  // namespace

Status checkMapped(const Credentials& c, std::string_view uid_map, std::string_view gid_map) {
  std::vector<Extent> uids = parseIdMap(uid_map), gids = parseIdMap(gid_map);
  auto outside = [&](const char* what, uint64_t id, const std::vector<Extent>& map) {
    return Status(Code::kInvalidArgument,
                  std::string(what) + " " + std::to_string(id) +
                      " is outside this sandbox's id mapping (" + describe(map) +
                      "): a node maps ids up to its --userns-width",
                  EINVAL, "user");
  };
  if (!mapped(uids, c.uid)) return outside("uid", c.uid, uids);
  if (!mapped(gids, c.gid)) return outside("gid", c.gid, gids);
  for (gid_t g : c.groups) {
    if (!mapped(gids, g)) return outside("supplementary gid", g, gids);
  }
  return Status::ok();
}

}  // namespace dsec::aether
