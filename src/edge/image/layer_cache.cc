#include "edge/image/layer_cache.h"

#include <fcntl.h>
#include <linux/loop.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <sstream>

#include "common/fd.h"
#include "common/log.h"
#include "common/util.h"
#include "edge/loop_device.h"
#include "edge/userns.h"

namespace dsec::edge {

namespace {
// mountinfo escapes spaces, tabs, newlines and backslashes as \ooo.
std::string unescapeMountPath(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      out.push_back(char((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// AUTOCLEAR: the device goes once the mount lets go of it.
constexpr uint32_t kLayerLoopFlags = LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR;

std::string hexOf(const std::string& digest) {
  return startsWith(digest, "sha256:") ? digest.substr(7) : digest;
}

// mount(2) takes at most a page of options: with at most 1 + kMaxExtraBlobs
// devices (image/fs_tree.h) of cache paths, far more than a layer needs.
constexpr size_t kMountDataMax = 4095;

// Mounts EROFS `source` read-only at `target` with one device= per entry of
// `devices`, in order (each adds the next device). The error keeps the errno.
Status mountErofs(const std::string& source, const std::vector<std::string>& devices,
                  const std::string& target) {
  std::string opts;
  for (auto& d : devices) opts += (opts.empty() ? "device=" : ",device=") + d;
  std::string what = "mount erofs " + source + (opts.empty() ? "" : " (" + opts + ")");
  if (opts.size() > kMountDataMax) {
    return Status(Code::kInvalidArgument, what + ": options over a page", E2BIG);
  }
  if (::mount(source.c_str(), target.c_str(), "erofs", MS_RDONLY | MS_NODEV | MS_NOSUID,
              opts.c_str()) != 0) {
    return sysError(what);
  }
  return Status::ok();
}
}  // namespace

std::vector<std::string> mountsUnder(const std::string& prefix) {
  std::vector<std::string> out;
  auto info = readFile("/proc/self/mountinfo");
  if (!info.isOk()) return out;
  std::istringstream in(*info);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string id, parent, devno, root, mp;
    ls >> id >> parent >> devno >> root >> mp;
    mp = unescapeMountPath(mp);
    if (mp == prefix || startsWith(mp, prefix + "/")) out.push_back(mp);
  }
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.size() > b.size(); });
  return out;
}

LayerCache::LayerCache(std::string mountRoot, NodeCache* cache)
    : mountRoot_(std::move(mountRoot)), cache_(cache) {}

LayerCache::~LayerCache() { close(); }

void LayerCache::close() {
  (void)unmountUnused(true);
  std::lock_guard lk(mu_);
  if (rootBound_ && ::umount2(mountRoot_.c_str(), MNT_DETACH) == 0) rootBound_ = false;
}

Status LayerCache::cleanupStale() {
  for (auto& mp : mountsUnder(mountRoot_)) {
    if (::umount2(mp.c_str(), MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT) {
      return sysError("umount stale layer " + mp);
    }
    log::info("removed stale layer mount " + mp);
  }
  RETURN_IF_ERROR(makeDirs(mountRoot_, 0700));
  // A shared mount of its own: layers mounted later propagate into the mount
  // namespaces of agents cloned earlier (the spare pool), until each agent
  // makes its tree private at start-up.
  if (::mount(mountRoot_.c_str(), mountRoot_.c_str(), nullptr, MS_BIND, nullptr) != 0) {
    return sysError("bind " + mountRoot_);
  }
  if (::mount(nullptr, mountRoot_.c_str(), nullptr, MS_SHARED, nullptr) != 0) {
    return sysError("make-shared " + mountRoot_);
  }
  rootBound_ = true;
  return Status::ok();
}

Status LayerCache::mountLayer(const LayerFiles& files, const std::string& target) {
  // EROFS devices 1, 2, ... in order: the layer's data blob, then its extras.
  std::vector<std::string> blobs;
  if (!files.data.empty()) blobs.push_back(files.data);
  blobs.insert(blobs.end(), files.extraData.begin(), files.extraData.end());
  if (method_ == "file") {
    Status st = mountErofs(files.meta, blobs, target);
    if (st.isOk()) return st;
    // Kernels before 6.12 want block devices for EROFS.
    if (st.sysErrno() != ENOTBLK && st.sysErrno() != EINVAL) return st;
    log::info("file-backed EROFS refused (" + st.message() + "); using loop devices");
    method_ = "loop";
  }
  // One loop device per file; each goes with the mount (autoclear), or at
  // once if the mount fails.
  std::vector<UniqueFd> loops;
  auto clear = [&] {
    for (auto& l : loops) ::ioctl(l.get(), LOOP_CLR_FD, 0);
  };
  std::vector<std::string> devs;
  std::vector<std::string> all = {files.meta};
  all.insert(all.end(), blobs.begin(), blobs.end());
  for (auto& f : all) {
    UniqueFd held;
    auto dev = attachLoop(f, kLayerLoopFlags, held);
    if (!dev.isOk()) {
      clear();
      return dev.status();
    }
    loops.push_back(std::move(held));
    devs.push_back(*dev);
  }
  Status st = mountErofs(devs[0], std::vector<std::string>(devs.begin() + 1, devs.end()), target);
  if (!st.isOk()) clear();
  return st;
}

Result<LayerCache::Mounted> LayerCache::acquireMount(const std::string& digest) {
  std::lock_guard lk(mu_);
  auto it = layers_.find(digest);
  int refs = 0;
  if (it != layers_.end()) {
    if (!cache_->broken(digest)) {
      ++it->second.refs;
      it->second.lastUsed = monoSeconds();
      return Mounted{it->second.path, it->second.files};
    }
    // Mounted over a loader process that died: sandboxes running on it keep
    // their (failing) mount, which their own mount namespaces hold; new ones
    // get a fresh mount over the new process. Their refs carry over, so
    // release() stays balanced.
    log::warn("layer " + digest + ": its loader process died; remounting it for new sandboxes");
    if (::umount2(it->second.path.c_str(), MNT_DETACH) != 0 && errno != EINVAL) {
      return sysError("umount broken layer " + it->second.path);
    }
    refs = it->second.refs;
    layers_.erase(it);
    cache_->unmounted(digest);
  }
  ASSIGN_OR_RETURN(LayerFiles files, cache_->prepare(digest));
  std::string target = mountRoot_ + "/" + hexOf(digest);
  Status st;
  if (::mkdir(target.c_str(), 0755) != 0 && errno != EEXIST) {
    st = sysError("mkdir " + target);
  } else if (st = mountLayer(files, target); !st.isOk()) {
    ::rmdir(target.c_str());
  }
  if (!st.isOk()) {
    cache_->unmounted(digest);
    return st;
  }
  layers_[digest] = Entry{target, files, refs + 1, monoSeconds()};
  trimLocked();
  return Mounted{target, files};
}

void LayerCache::trimLocked() {
  if (cache_->limitBytes() <= 0 || cache_->usedBytes() <= cache_->limitBytes()) return;
  std::vector<std::pair<double, std::string>> unused;
  for (auto& [d, e] : layers_) {
    if (e.refs == 0) unused.push_back({e.lastUsed, d});
  }
  std::sort(unused.begin(), unused.end());
  for (auto& [_, d] : unused) {
    auto it = layers_.find(d);
    if (::umount2(it->second.path.c_str(), MNT_DETACH) != 0 && errno != EINVAL) continue;
    ::rmdir(it->second.path.c_str());
    layers_.erase(it);
    cache_->unmounted(d);
    std::set<std::string> mounted;
    for (auto& [m, e] : layers_) mounted.insert(m);
    cache_->trim(mounted);
    if (cache_->usedBytes() <= cache_->limitBytes()) return;
  }
  std::set<std::string> mounted;
  for (auto& [m, e] : layers_) mounted.insert(m);
  cache_->trim(mounted);
}

void LayerCache::release(const std::string& digest) {
  std::lock_guard lk(mu_);
  auto it = layers_.find(digest);
  if (it != layers_.end() && it->second.refs > 0) {
    --it->second.refs;
    it->second.lastUsed = monoSeconds();
  }
}

Status LayerCache::evict(const std::string& digest) {
  std::lock_guard lk(mu_);
  auto it = layers_.find(digest);
  if (it == layers_.end()) return Status::ok();
  if (it->second.refs > 0) {
    return Status(Code::kFailedPrecondition, "layer " + digest + " is mounted for a sandbox");
  }
  if (::umount2(it->second.path.c_str(), MNT_DETACH) != 0 && errno != EINVAL) {
    return sysError("umount " + it->second.path);
  }
  ::rmdir(it->second.path.c_str());
  layers_.erase(it);
  cache_->unmounted(digest);
  return Status::ok();
}

Status LayerCache::unmountUnused(bool force) {
  std::lock_guard lk(mu_);
  Status first;
  for (auto it = layers_.begin(); it != layers_.end();) {
    if (it->second.refs > 0 && !force) {
      ++it;
      continue;
    }
    // Sandboxes' mount namespaces hold their own references, so a lazy
    // unmount here never pulls a layer out from under a running sandbox.
    if (::umount2(it->second.path.c_str(), MNT_DETACH) != 0 && errno != EINVAL) {
      if (first.isOk()) first = sysError("umount " + it->second.path);
    }
    ::rmdir(it->second.path.c_str());
    cache_->unmounted(it->first);
    it = layers_.erase(it);
  }
  return first;
}

std::string LayerCache::mountMethod() const {
  std::lock_guard lk(mu_);
  return method_;
}

}  // namespace dsec::edge
