#include "edge/sandbox_state.h"

#include <dirent.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/log.h"
#include "common/util.h"

namespace dsec::edge {

using json = nlohmann::json;

namespace {

json ruleJson(const proto::EgressRule& r) {
  size_t len = r.family == AF_INET6 ? 16 : 4;
  std::string addr;
  char b[3];
  for (size_t i = 0; i < len; ++i) {
    std::snprintf(b, sizeof b, "%02x", r.addr[i]);
    addr += b;
  }
  json ports = json::array();
  for (auto& p : r.ports) ports.push_back({p.lo, p.hi});
  return {{"family", r.family == AF_INET6 ? 6 : 4}, {"addr", addr}, {"prefix", r.prefixLen},
          {"ports", ports}};
}

Result<proto::EgressRule> ruleFrom(const json& j) {
  proto::EgressRule r;
  int fam = j.at("family").get<int>();
  if (fam != 4 && fam != 6) return invalidArg("egress", "bad family");
  r.family = fam == 6 ? AF_INET6 : AF_INET;
  std::string addr = j.at("addr").get<std::string>();
  size_t len = fam == 6 ? 16 : 4;
  if (addr.size() != 2 * len) return invalidArg("egress", "bad address");
  for (size_t i = 0; i < len; ++i) {
    r.addr[i] = uint8_t(std::stoul(addr.substr(2 * i, 2), nullptr, 16));
  }
  r.prefixLen = j.at("prefix").get<int>();
  if (r.prefixLen < 0 || r.prefixLen > int(len * 8)) return invalidArg("egress", "bad prefix");
  for (auto& p : j.at("ports")) {
    r.ports.push_back({p.at(0).get<uint16_t>(), p.at(1).get<uint16_t>()});
  }
  return r;
}

}  // namespace

std::string encodeSandboxState(const SandboxState& s) {
  json egress = json::array();
  for (auto& r : s.egress) egress.push_back(ruleJson(r));
  json j = {{"version", 1},
            {"id", s.spec.id},
            {"backend", proto::backendName(s.backend)},
            {"layers", s.spec.layers},
            {"cpu", s.spec.cpu},
            {"memory_bytes", s.spec.memoryBytes},
            {"disk_bytes", s.spec.diskBytes},
            {"pids", s.spec.pids},
            {"pid", s.pid},
            {"start_time", s.startTime},
            {"egress", egress},
            {"paused", s.paused},
            {"network", s.spec.network}};
  if (s.hibernated) j["hibernated"] = true;
  if (!s.userns.empty()) j["userns"] = {{"base", s.userns.base}, {"length", s.userns.length}};
  return j.dump();
}

Result<SandboxState> decodeSandboxState(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  if (!j.is_object()) return invalidArg("state", "not a JSON object");
  try {
    if (j.at("version").get<int>() != 1) return invalidArg("state", "unknown version");
    SandboxState s;
    s.spec.id = j.at("id").get<std::string>();
    auto backend = proto::parseBackend(j.at("backend").get<std::string>());
    if (!backend) return invalidArg("state", "unknown backend");
    s.backend = *backend;
    s.spec.layers = j.at("layers").get<std::vector<std::string>>();
    s.spec.cpu = j.at("cpu").get<double>();
    s.spec.memoryBytes = j.at("memory_bytes").get<int64_t>();
    s.spec.diskBytes = j.at("disk_bytes").get<int64_t>();
    s.spec.pids = j.at("pids").get<int64_t>();
    s.pid = j.at("pid").get<pid_t>();
    s.startTime = j.at("start_time").get<uint64_t>();
    for (auto& r : j.at("egress")) {
      ASSIGN_OR_RETURN(auto rule, ruleFrom(r));
      s.egress.push_back(std::move(rule));
    }
    s.paused = j.at("paused").get<bool>();
    s.hibernated = j.value("hibernated", false);
    s.spec.network = j.value("network", false);  // absent in files of older edges
    if (j.contains("userns")) {  // absent in files of older edges
      const json& u = j.at("userns");
      uint64_t base = u.at("base").get<uint64_t>(), length = u.at("length").get<uint64_t>();
      // Never host root, never (uid_t)-1.
      if (base == 0 || length == 0 || base + length > 0xffffffffull) {
        return invalidArg("state", "bad userns range");
      }
      s.userns = IdRange{uint32_t(base), uint32_t(length)};
    }
    if (!startsWith(s.spec.id, "sb-")) return invalidArg("state", "bad id");
    // A hibernated sandbox has no process; any other has a PID 1.
    if (s.hibernated ? s.pid != -1 : s.pid <= 1) return invalidArg("state", "bad pid");
    return s;
  } catch (const std::exception& e) {
    return invalidArg("state", e.what());
  }
}

Result<uint64_t> processStartTime(pid_t pid) {
  ASSIGN_OR_RETURN(std::string stat, readFile("/proc/" + std::to_string(pid) + "/stat"));
  // The command name (field 2) may hold spaces and parentheses: count from
  // the last ')'.
  size_t close = stat.rfind(')');
  if (close == std::string::npos) return internalError("malformed /proc stat");
  auto fields = splitString(stat.substr(close + 2), ' ');
  // fields[0] is field 3 (state); field 22 is fields[19].
  if (fields.size() < 20) return internalError("malformed /proc stat");
  return std::stoull(fields[19]);
}

Status SandboxStateDir::open() { return makeDirs(dir_, 0700); }

Status SandboxStateDir::put(const SandboxState& s) {
  std::string path = pathOf(s.spec.id);
  std::string tmp = path + ".tmp";
  std::string data = encodeSandboxState(s);
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!fd) return sysError("create " + tmp);
  if (::write(fd.get(), data.data(), data.size()) != ssize_t(data.size())) {
    Status st = sysError("write " + tmp);
    ::unlink(tmp.c_str());
    return st;
  }
  fd.reset();
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    Status st = sysError("rename " + tmp);
    ::unlink(tmp.c_str());
    return st;
  }
  return Status::ok();
}

void SandboxStateDir::remove(const std::string& id) {
  if (::unlink(pathOf(id).c_str()) != 0 && errno != ENOENT) {
    log::warn("remove state of " + id + ": " + std::strerror(errno));
  }
}

std::vector<SandboxState> SandboxStateDir::loadAll(std::vector<std::string>* bad) {
  std::vector<SandboxState> out;
  DIR* d = ::opendir(dir_.c_str());
  if (!d) return out;
  std::vector<std::string> names;
  while (auto* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);
  for (auto& name : names) {
    if (name == "." || name == "..") continue;
    std::string path = dir_ + "/" + name;
    if (name.size() < 5 || name.compare(name.size() - 5, 5, ".json") != 0) {
      ::unlink(path.c_str());  // a torn .tmp
      continue;
    }
    auto text = readFile(path);
    auto s = text.isOk() ? decodeSandboxState(*text) : Result<SandboxState>(text.status());
    if (!s.isOk() || pathOf(s->spec.id) != path) {
      log::warn("dropping unreadable sandbox state " + path + ": " +
                (s.isOk() ? "its id does not match its name" : s.status().toString()));
      ::unlink(path.c_str());
      if (bad) bad->push_back(name);
      continue;
    }
    out.push_back(std::move(*s));
  }
  return out;
}

}  // namespace dsec::edge
