#include "image/credential_helper.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/util.h"

extern char** environ;

namespace dsec::image {

namespace {

using Json = nlohmann::json;

constexpr std::string_view kDockerHub = "docker.io";
constexpr size_t kMaxAnswer = 1 << 20;


bool plainWord(const std::string& s) {
  if (s.empty() || s.size() > 100) return false;
  for (char c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

}  // namespace

Result<std::optional<std::string>> credentialHelperFor(std::string_view configJson,
                                                       std::string_view host) {
  Json j;
  try {
    j = Json::parse(configJson);
  } catch (const Json::parse_error& e) {
    return invalidArg("auth",
                      "docker config is not valid JSON (at byte " + std::to_string(e.byte) + ")");
  }
  if (!j.is_object()) return invalidArg("auth", "docker config is not a JSON object");
  const std::string want = asciiLower(host);
  auto named = [&](const Json& v, const std::string& where) -> Result<std::optional<std::string>> {
    if (!v.is_string() || !plainWord(v.get<std::string>())) {
      return invalidArg("auth", "docker config: " + where + " is not a helper name");
    }
    return std::optional<std::string>(v.get<std::string>());
  };
  if (auto h = j.find("credHelpers"); h != j.end() && !h->is_null()) {
    if (!h->is_object()) return invalidArg("auth", "docker config: \"credHelpers\" is not an object");
    std::vector<std::string> keys;
    for (auto it = h->begin(); it != h->end(); ++it) keys.push_back(it.key());
    if (auto key = dockerConfigKeyFor(keys, host)) return named((*h)[*key], "credHelpers of " + want);
  }
  if (auto s = j.find("credsStore"); s != j.end() && !s->is_null()) {
    if (s->is_string() && s->get<std::string>().empty()) return std::optional<std::string>();
    return named(*s, "\"credsStore\"");
  }
  return std::optional<std::string>();
}

Result<std::optional<RegistryCredentials>> runCredentialHelper(const std::string& name,
                                                               std::string_view host,
                                                               double timeoutS) {
  if (!plainWord(name)) return invalidArg("auth", "credential helper \"" + name + "\" is not a name");
  const std::string prog = "docker-credential-" + name;
  const std::string server =
      asciiLower(host) == kDockerHub ? "https://index.docker.io/v1/" : std::string(host);
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) return sysError("pipe");
  UniqueFd inR(in[0]), inW(in[1]);
  if (::pipe2(out, O_CLOEXEC) != 0) return sysError("pipe");
  UniqueFd outR(out[0]), outW(out[1]);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, inR.get(), 0);
  posix_spawn_file_actions_adddup2(&fa, outW.get(), 1);
  posix_spawn_file_actions_adddup2(&fa, outW.get(), 2);
  char* argv[] = {const_cast<char*>(prog.c_str()), const_cast<char*>("get"), nullptr};
  pid_t pid = 0;
  int rc = posix_spawnp(&pid, prog.c_str(), &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc == ENOENT) {
    return Status(Code::kNotFound, "credential helper " + prog + " is not on PATH", 0, "auth");
  }
  if (rc != 0) return sysError("spawn " + prog, rc);
  inR.reset();
  outW.reset();
  {
    // A helper that exits without reading its input must not kill us with
    // SIGPIPE: blocked for this thread, and a pending one taken back.
    sigset_t pipeSet, old;
    sigemptyset(&pipeSet);
    sigaddset(&pipeSet, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipeSet, &old);
    std::string input = server + "\n";
    if (::write(inW.get(), input.data(), input.size()) < 0 && errno == EPIPE) {
      timespec zero{0, 0};
      (void)sigtimedwait(&pipeSet, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
  }
  inW.reset();
  std::string answer;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeoutS);
  bool timedOut = false;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timedOut = true;
      break;
    }
    pollfd p{outR.get(), POLLIN, 0};
    int n = ::poll(&p, 1, int(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) continue;
    char buf[4096];
    ssize_t got = ::read(outR.get(), buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    if (answer.size() < kMaxAnswer) answer.append(buf, size_t(got));
  }
  if (timedOut) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  auto unavailable = [&](const std::string& why) {
    return Status(Code::kUnavailable, "credential helper " + prog + " " + why, 0, "auth");
  };
  if (timedOut) return unavailable("ran longer than " + std::to_string(int(timeoutS)) + " s");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    // The protocol's answer for a registry it has nothing for.
    if (answer.find("credentials not found") != std::string::npos) {
      return std::optional<RegistryCredentials>();
    }
    std::string first = answer.substr(0, answer.find('\n'));
    if (first.size() > 200) first = first.substr(0, 200) + "...";
    return unavailable("failed (status " + std::to_string(status) + "): " + first);
  }
  try {
    Json j = Json::parse(answer);
    if (!j.is_object() || !j.contains("Username") || !j.contains("Secret") ||
        !j["Username"].is_string() || !j["Secret"].is_string()) {
      return unavailable("answered without a string Username and Secret");
    }
    RegistryCredentials c;
    if (j["Username"] == "<token>") {
      c.identityToken = j["Secret"].get<std::string>();
    } else {
      c.username = j["Username"].get<std::string>();
      c.password = j["Secret"].get<std::string>();
    }
    if (c.username.empty() && c.password.empty() && c.identityToken.empty()) {
      return std::optional<RegistryCredentials>();
    }
    return std::optional<RegistryCredentials>(std::move(c));
  } catch (const std::exception&) {
    return unavailable("answered something that is not JSON");
  }
}

}  // namespace dsec::image
