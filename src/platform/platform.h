// The control plane: authenticates and validates API calls, owns the record
// of every sandbox (persisted before any reply), resolves images to layers and
// drives the edge. In `dsec up` the edge is in-process; the Edge type is the
// seam a remote edge client will take later.
//
// Threading: API calls arrive on many HTTP threads. mu_ guards sandboxes_;
// edge calls are made without it. A janitor thread enforces TTLs.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <queue>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/http_proxy.h"
#include "common/http_server.h"
#include "common/metrics.h"
#include "common/status.h"
#include "image/block_ranges.h"
#include "platform/chronus.h"
#include "platform/chunk_keys.h"
#include "platform/cluster.h"
#include "platform/metrics_history.h"
#include "platform/policy.h"
#include "platform/processes.h"
#include "platform/pull_manager.h"
#include "platform/run_pool.h"
#include "platform/store.h"
#include "platform/tenants.h"
#include "proto/edge_link.h"

namespace dsec::platform {

struct E2bWatcher;  // api_e2b_envd.cc

struct PlatformOptions {
  std::string dataDir;
  std::string token;
  double stoppedRetentionS = 3600;  // stopped sandboxes stay listed this long,
  // and at most this many of them (the longest stopped go first): at a
  // trainer's churn (200 destroys a second) an hour is 720,000 records,
  // ~2 KB each in memory and a row each in the store. As Kubernetes bounds
  // terminated pods (terminated-pod-gc-threshold, 12,500).
  size_t stoppedRetentionMax = 10000;
  double gcGraceS = 600;            // unreferenced layers older than this are collected
  double gcIntervalS = 60;          // how often the janitor collects
  // What the built-in `setup` policy allows (platform/policy.h): egress
  // entries and DNS resolvers; none by default.
  std::vector<std::string> setupEgress;
  std::vector<std::string> setupDns;
  // Trajectories whose last step is older than this are deleted (0: never).
  double trajectoryRetentionS = 7 * 86400;
  // Live restore (the node's EdgeOptions::liveRestore): shutdown() leaves live
  // sandboxes running, recorded as they are, for the next start.
  bool liveRestore = false;
  // fncall one-shot calls (POST /v1/run, api_run.cc): the image a call that
  // names none runs on, and the warm pools' bounds.
  std::string runImage = "debian:latest";
  RunPoolOptions runPool;
  // Batch creations (api_batches.cc): threads creating a batch's sandboxes
  // concurrently (each waits on one node call at a time), at most; they
  // start as batches come and stay.
  int batchWorkers = 128;
  // Replicas on a shared store (docs/cluster.md): this replica's id, kept in
  // the records it creates, and whether it is the leader now (it alone runs
  // the janitor's sweeps); unset: always.
  std::string replicaId;
  std::function<bool()> leader;
  // Where GET /v1/metrics comes from: the platform adds its collector
  // (platform, cluster, in-process node, run pool) at start and removes it
  // when destroyed, and the endpoint renders the whole registry, so other
  // parts of the process may add theirs. Not owned; outlives the Platform.
  // One Platform per registry (the API error counter is the process's).
  metrics::Registry* registry = &metrics::Registry::global();
  // Registry pulls (api_pull.cc): layers fetched and converted at once over
  // all pulls; registries reached over plain http (host[:port] as in refs);
  // a PEM bundle trusted instead of the system CAs; a Docker-style
  // config.json (its text) whose credentials are used when a pull brings
  // none.
  int pullWorkers = 4;
  std::vector<std::string> insecureRegistries;
  // Registries (host[:port]) tenants other than admins may pull from even
  // though they resolve to loopback, private or link-local addresses; those
  // in insecureRegistries count too. Admins may pull from anywhere.
  std::vector<std::string> registryAllow;
  std::string registryCa;
  std::string registryAuth;
  // Exposed ports (docs/ports.md). The host form's URLs are
  // {exposeScheme}://{port}-{id}.{exposeDomain}[:{exposePort}]/ (exposePort 0:
  // the listener's port, -1: none, as behind an ingress on 443); an empty
  // domain turns the host form off. publicUrl is the platform's URL as
  // clients reach it, for the path form (empty: the listener's).
  // The console's charts (GET /v1/metrics/history): a sample of chosen
  // metrics this often, the last hour kept (platform/metrics_history.h).
  double metricsHistoryIntervalS = 10;
  std::string exposeDomain = "localhost";
  std::string exposeScheme = "http";
  int exposePort = 0;
  std::string publicUrl;
};

class Platform {
 public:
  // `cluster` (not owned) is where every sandbox lives: its nodes.
  static Result<std::unique_ptr<Platform>> start(PlatformOptions opts, Store* store,
                                                 Cluster* cluster);
  ~Platform();

  // The REST API (api/openapi.yaml).
  void handle(http::Request& req, http::Response& res);
  // For routes served beside the API (GET /v1/nodes: cli/cluster_cmd.cc):
  // ok for an admin's key in `authorization` ("Bearer …"), else
  // kUnauthenticated or kPermissionDenied as the API would answer.
  Status checkAdmin(const std::string& authorization);
  // Exposed ports (api_ports.cc, docs/ports.md): the server's divert hook
  // (http::ServerOptions::divert). A request for an exposed port (the path
  // form /ports/{id}/{port}/..., or a Host {port}-{id}.{exposeDomain}) gets
  // a taker that hands its connection to the reverse proxy
  // (common/http_proxy.h); any other request an empty one. Non-blocking.
  http::ServerOptions::Taker divertPort(const http::Request& req);
  // The listener's URL ("http://127.0.0.1:7070"), for the URLs expose
  // answers with; set once the server listens.
  void setListenUrl(std::string url);
  // Destroys every live sandbox, recording each as stopped. Thread-safe and
  // idempotent; creates still in flight undo themselves.
  void shutdown();

  // Where the blob of a layer digest lives locally.
  static std::string blobPath(const std::string& dataDir, const std::string& digest);
  // What a node needs to fetch and mount layer `digest`: its metadata image,
  // data blob and the data blob's chunk index (made now for layers stored
  // before chunk indexes existed).
  static Result<proto::LayerDesc> describeLayer(Store* store, const std::string& dataDir,
                                               const std::string& digest);
  // Writes the chunk index of data blob `dataDigest` beside it in the blob
  // directory and records its digest, unless it has one.
  static Result<std::string> ensureChunkIndex(Store* store, const std::string& dataDir,
                                              const std::string& dataDigest);
  // The layer digests of image ref `ref` (NAME[:TAG], any owner), or {ref}
  // for a stored layer digest: what nodes pre-stage (docs/cluster.md).
  static Result<std::vector<std::string>> layersOfRef(Store* store, const std::string& ref);

 private:
  Platform() = default;

  // Sandboxes (api_sandboxes.cc).
  void createSandbox(http::Request& req, http::Response& res);
  // From a checked record (layers resolved; env, user and working dir final;
  // no phases yet) to a running sandbox with a fresh id, persisted; on error
  // nothing is left (no record, nothing on the edge).
  Result<SandboxRecord> launch(SandboxRecord r);
  // A create body (checked object) to a record: layers resolved, env, user
  // and working dir final. Errors name the field.
  Result<SandboxRecord> checkCreate(const nlohmann::json& j);
  // Creates r (id set) on its node with its first policy phase; on error the
  // node keeps nothing.
  Status createOnEdge(SandboxRecord& r);
  // A batch worker's group (docs/batches.md): created with one call per node
  // through Cluster::createGroup; an entry without a status was not attempted
  // (no room on the group's node right now) and goes back to the queue.
  std::vector<std::optional<Status>> createManyOnEdge(std::vector<SandboxRecord>& rs);
  static constexpr size_t kBulkCreate = 16;  // sandboxes a batch worker takes at once
  // Batches (api_batches.cc): POST/GET /v1/batches, GET/DELETE
  // /v1/batches/{id}, DELETE /v1/sandboxes?label=k=v|batch=ID.
  void batchesApi(const std::vector<std::string>& parts, http::Request& req, http::Response& res);
  void createBatch(http::Request& req, http::Response& res);
  nlohmann::json batchToApi(const std::string& id);
  void destroyMatching(http::Request& req, http::Response& res);
  // Destroys the sandboxes `ids` together: pending ones are never created,
  // nodes are called concurrently, and every final record is stored in one
  // transaction before it returns. Returns how many it stopped.
  Result<int64_t> destroyMany(const std::vector<std::string>& ids, const std::string& why);
  // Resumes batches at start: their pending records, under fresh ids.
  Status resumeBatches(std::vector<SandboxRecord>& records);
  void batchWorker();
  // Starts workers while the queue holds more than the idle ones take
  // (batchMu_ held).
  void growBatchWorkersLocked();
  void batchCommitter();
  // Ends batch `id` when none of its sandboxes is pending; batchMu_ held.
  void settleBatchLocked(const std::string& id);
  // Stops the batch threads (idempotent); outcomes gathered are stored first.
  void stopBatches();
  void listSandboxes(http::Request& req, http::Response& res);
  void getSandbox(const std::string& id, http::Response& res);
  void deleteSandbox(const std::string& id, http::Response& res);
  // Exec answers when the agent's frames complete the exec: the handler
  // defers its response and returns (no thread waits for the exec).
  // `activity` keeps the sandbox's idle timers at bay until it ends; a client
  // that goes away cancels the exec (not a trajectory step's, which the log
  // keeps).
  void execSandbox(const std::string& id, http::Request& req, http::Response& res,
                   std::shared_ptr<void> activity);
  // Process sessions (api_processes.cc): /v1/sandboxes/{id}/processes[/{pid}[/op]].
  void processesApi(const std::string& id, const std::vector<std::string>& parts,
                    http::Request& req, http::Response& res, std::shared_ptr<void> activity);
  void startProcess(const std::string& id, http::Request& req, http::Response& res,
                    std::shared_ptr<void> activity);
  // A process session from a POST /processes body (the REST API's and
  // E2B's), running once this returns.
  Result<std::shared_ptr<ProcessSession>> startSession(const std::string& id,
                                                       const nlohmann::json& body,
                                                       http::Request& req,
                                                       std::shared_ptr<void> activity);
  // A sandbox's session by pid, else the newest (running first) with `tag`.
  std::shared_ptr<ProcessSession> findSession(const std::string& id, int pid,
                                              const std::string& tag);
  // A sandbox's file as the response's body (octet-stream); an error before
  // the body began is returned for the caller to answer with, one after it
  // cuts the response short.
  Status sendSandboxFile(const std::string& id, const std::string& path, http::Response& res);
  // Pauses (toDisk: a VM to disk) or resumes a sandbox, recorded.
  Result<SandboxRecord> pauseOrResume(const std::string& id, bool pause, bool toDisk);
  // Moves the sandbox's end to `seconds` from now (longer or shorter), recorded.
  Result<SandboxRecord> expireIn(const std::string& id, double seconds);
  // A sandbox the caller may see and that is running or paused; kNotFound
  // (field sandboxID) otherwise.
  Result<SandboxRecord> visibleSandbox(const std::string& id);

  // E2B compatibility (docs/e2b.md): its control API under /e2b/api
  // (api_e2b.cc) and its in-sandbox API under /e2b/envd (api_e2b_envd.cc).
  void e2bControl(const std::vector<std::string>& p, http::Request& req, http::Response& res);
  void e2bCreate(http::Request& req, http::Response& res);
  void e2bList(http::Request& req, http::Response& res);
  nlohmann::json e2bSandbox(const SandboxRecord& r) const;
  nlohmann::json e2bListed(const SandboxRecord& r) const;
  // Exposed ports (api_ports.cc).
  // Holds the sandbox as in use (callsInFlight_) until the last copy goes:
  // no idle timeout or auto-pause meanwhile.
  std::shared_ptr<void> holdActivity(const std::string& id);
  // GET /v1/trajectories/{id}/info (api_trajectories.cc).
  void trajectoryInfo(const std::string& id, http::Response& res);
  void portsApi(const std::string& id, const std::vector<std::string>& parts,
                http::Request& req, http::Response& res);
  // The URL token of an exposure: HMAC-SHA256(the platform's token,
  // "dsec-port/1 id port gen"), "dpt_" + hex.
  std::string portToken(const std::string& id, int port, uint64_t gen) const;
  nlohmann::json portJson(const SandboxRecord& r, const SandboxRecord::ExposedPort& p);
  // Tells the sandbox's node its exposures now (it cuts the others).
  Status pushPorts(const SandboxRecord& r);
  // Janitor: drops exposures whose ttl ran out.
  void expirePorts();
  void writePortMetrics(metrics::Writer& w);
  http::ProxyDecision routePort(const http::ProxyRequest& r, const std::string& id, int port,
                                bool hostForm);

  // The per-sandbox envd token: HMAC-SHA256(the platform's token, id).
  std::string envdToken(const std::string& sandboxId) const;
  void e2bEnvd(const std::vector<std::string>& p, http::Request& req, http::Response& res);
  void e2bProcess(const SandboxRecord& rec, const std::string& method, const nlohmann::json& j,
                  const std::string& user, bool stream, http::Request& req, http::Response& res);
  void e2bFilesystem(const SandboxRecord& rec, const std::string& method,
                     const nlohmann::json& j, const std::string& user, bool stream,
                     http::Request& req, http::Response& res);
  void e2bWatch(const SandboxRecord& rec, const std::string& path, bool recursive,
                bool includeEntry, http::Request& req, http::Response& res);
  void e2bFiles(const SandboxRecord& rec, http::Request& req, http::Response& res);
  void e2bWatcher(const SandboxRecord& rec, const std::string& method, const nlohmann::json& j,
                  const std::string& user, http::Response& res);
  Result<std::string> e2bPath(const SandboxRecord& rec, const std::string& user,
                              const std::string& path);
  bool validFileSignature(const std::string& id, http::Request& req);
  // fncall (api_run.cc): POST /v1/run (a one-shot call in a warm pool) and
  // POST /v1/sandboxes/{id}/run (a call in a fncall sandbox's /scratch).
  void runCode(http::Request& req, http::Response& res);
  void runInSandbox(const std::string& id, http::Request& req, http::Response& res,
                    std::shared_ptr<void> activity);
  // An exec request checked against the running sandbox: what to run and how
  // to answer. Errors name the field.
  struct ExecPlan {
    proto::ExecSpec spec;
    bool b64 = false;
    bool streaming = false;
  };
  Result<ExecPlan> planExec(const std::string& id, const nlohmann::json& j, http::Request& req);
  // A step's answer: the Dsec-Replayed and Dsec-Step-Digest headers, and for
  // JSON results "replayed", "trajectory_id" and "step" in the object (the
  // trajectory id as the current caller named it).
  struct StepAnswer {
    std::vector<std::pair<std::string, std::string>> headers;
    int status = 200;
    std::string contentType;
    std::string body;
  };
  StepAnswer stepAnswer(const StepKey& key, const StepOutcome& o);
  void sendStep(http::Response& res, const StepKey& key, const StepOutcome& o);
  void sendStep(http::Deferred& d, const StepKey& key, const StepOutcome& o);
  // Re-executes a logged mutating step in sandbox `id` (api_sandboxes.cc):
  // null when its result matches the log, else the divergence as an object;
  // an error when it could not be attempted (see the definition).
  Result<nlohmann::json> reexecStep(const std::string& id, const TrajectoryStep& s,
                                    http::Request& req);
  void fileStep(const std::string& id, const std::string& op, const StepKey& key,
                http::Request& req, http::Response& res);
  void packDiff(const std::string& id, http::Request& req, http::Response& res);
  // Packs sandbox `id`'s changes into the diff image named by img.name/tag
  // and stores it; returns the image.
  Result<ImageRecord> packDiffImage(const std::string& id, ImageRecord img);
  Result<ImageRecord> packDiskImage(const SandboxRecord& sb, const image::BuiltLayer& disk,
                                    const std::string& work, ImageRecord img);
  void getAudit(const std::string& id, http::Response& res);
  // GET /v1/sandboxes/{id}/stats?window_s=: the node's readings of its CPU,
  // memory and tasks (EdgeLink::statsHistory) with the limits in force.
  void getStats(const std::string& id, http::Request& req, http::Response& res);
  // Computer use (api_computer.cc, backend vm): the screen as PNG, and
  // keyboard/mouse input.
  void screenshot(const std::string& id, http::Response& res);
  void sendInput(const std::string& id, http::Request& req, http::Response& res);
  void setPhase(const std::string& id, http::Request& req, http::Response& res);
  void pauseSandbox(const std::string& id, bool pause, http::Request& req,
                    http::Response& res);
  // The janitor's: pauses a running sandbox that has been idle (auto_pause_s).
  void autoPause(const std::string& id);
  // Trajectories (api_trajectories.cc).
  void listTrajectories(http::Response& res);
  void exportTrajectory(const std::string& id, http::Response& res);
  void deleteTrajectory(const std::string& id, http::Response& res);
  // POST /v1/trajectories/{id}/recover: a new sandbox like the trajectory's
  // lost one, from its latest usable checkpoint, with the mutating steps
  // logged after it re-executed in order; it becomes the trajectory's sandbox.
  void recoverTrajectory(const std::string& id, http::Request& req, http::Response& res);
  Result<nlohmann::json> runRecover(const std::string& id, bool force, http::Request& req);
  // The sandbox a step of `trajectory` addressed to sandbox `id` runs in: the
  // trajectory's sandbox if a recover replaced `id`, else `id`.
  std::string routeStep(const std::string& id, const std::string& trajectory);
  // After a live step of `trajectory` ran in `sandbox`: if that is not the
  // trajectory's recorded sandbox, records it with its record (which a
  // recover needs after the sandbox's own record is purged). Best effort.
  void noteStepSandbox(const std::string& trajectory, const std::string& sandbox);
  // The trajectory's record, cached (without sandboxDoc); kNotFound if none.
  Result<TrajectoryRecord> trajectoryRecord(const std::string& trajectory);
  // Bytes of write steps, kept content-addressed under <data>/steps/ so a
  // recover can write them again. keepStepBytes stores them durably and pins
  // the digest against sweeps until unpinStepBytes (after the step is stored
  // or failed). releaseStepBytes unlinks those of `digests` no stored step
  // keeps; sweepStepBytes (run with GC) every such file.
  std::string stepBytesPath(const std::string& digest) const;
  Result<std::string> keepStepBytes(std::string_view data);
  void unpinStepBytes(const std::string& digest);
  void releaseStepBytes(const std::set<std::string>& digests);
  Status sweepStepBytes();
  // Policies (api_policies.cc).
  void listPolicies(http::Response& res);
  void createPolicy(http::Request& req, http::Response& res);
  void getPolicy(const std::string& name, http::Response& res);
  void deletePolicy(const std::string& name, http::Response& res);
  // The filter rules of p's egress and DNS entries, host names resolved now.
  Result<std::vector<proto::EgressRule>> egressRules(const Policy& p);
  // What r's policy (plus its extra paths) asks of its sandbox: the limits
  // (the lower of the sandbox's own and the policy's ceilings), the policy
  // frame's body for the agent (file rules, resolvers, syscall profile) and
  // the egress rules.
  struct PolicyPlan {
    proto::CgroupLimits limits;
    std::string agentBody;
    std::vector<proto::EgressRule> egress;
  };
  Result<PolicyPlan> planPolicy(const SandboxRecord& r);
  proto::SandboxSpec edgeSpec(const SandboxRecord& r, const PolicyPlan& plan);
  // Applies r's policy to its running sandbox (a phase switch).
  Status applyPolicy(const SandboxRecord& r);
  void files(const std::string& id, const std::string& op, http::Request& req,
             http::Response& res);
  // Images and blobs (api_images.cc).
  void putBlob(const std::string& digest, http::Request& req, http::Response& res);
  void headBlob(const std::string& digest, http::Response& res);
  void createImage(http::Request& req, http::Response& res);
  void listImages(http::Response& res);
  void getImage(const std::string& ref, http::Response& res);
  void deleteImage(const std::string& ref, http::Response& res);
  void listLayers(http::Response& res);
  void getLayer(const std::string& digest, http::Response& res);
  void deleteLayer(const std::string& digest, http::Response& res);
  void runGc(http::Request& req, http::Response& res);
  // Registry pulls (api_pull.cc).
  void pullImage(http::Request& req, http::Response& res);
  void startPulls();
  // PullHooks: a downloaded layer made a dsec layer, moved into the store,
  // and found again by its registry digest.
  Result<image::ConvertedLayer> convertPulledLayer(const std::string& spool,
                                                   const image::RegistryLayer& layer,
                                                   const std::string& work);
  Status commitPulledLayer(const image::ConvertedLayer& layer, const std::string& source);
  // Moves a layer the streaming converter made (pull, build COPY) into the
  // blob store and records it: its data blob and chunk index, the chunks it
  // stored (for later layers to find), and the layer with its extra blobs.
  Status storeConvertedLayer(const image::ConvertedLayer& c);
  // The chunk table (Store::findChunk) as the converter's ChunkSource: the
  // blobs it answers with stay out of gc's reach while it lives.
  std::shared_ptr<image::ChunkSource> chunkSource();
  // Names this replica's work directories in the shared blob directory
  // (pull and build steps), so that it sweeps only its own after a crash.
  std::string workTag() const;
  std::optional<std::string> pulledLayer(const std::string& source);
  // The registry options of pulls the platform starts itself (dsec up's
  // --insecure-registry, --registry-ca, --registry-auth).
  image::RegistryOptions registryOptions(const image::RegistryRef& ref) const;
  // name:tag if it was pulled from manifest `manifestDigest` and is whole.
  std::optional<ImageRecord> pulledAlready(const std::string& name, const std::string& tag,
                                           const std::string& manifestDigest);
  // Resolves `ref` and, unless `target` (name, tag, owner, visibility) is
  // already that manifest, fetches what is missing and stores the image.
  // Blocks the calling thread until done; errors as POST /v1/images/pull's.
  Result<ImageRecord> pullAndWait(const image::RegistryRef& ref,
                                  const image::ImagePlatform& platform, ImageRecord target,
                                  const image::RegistryOptions& ro);
  // A sandbox create naming an image that is not here: pulled when its name
  // starts with a registry host (127.0.0.1:5000/app, ghcr.io/org/app); else
  // kNotFound.
  Result<ImageRecord> pullOnCreate(const std::string& name, const std::string& tag);
  // Bytes of an image's layers: logical (metadata and data of each layer,
  // repeats counted again) and stored (each distinct blob once).
  struct ImageBytes {
    int64_t logical = 0;
    int64_t stored = 0;
  };
  Result<ImageBytes> imageBytes(const ImageRecord& img);
  void writeImageMetrics(metrics::Writer& w);
  // The image of a pull whose layers are all there, stored.
  Result<ImageRecord> finishPull(ImageRecord r, const image::ResolvedImage& resolved,
                                 const std::vector<std::string>& layers);
  // Builds (api_build.cc): POST /v1/images/build. ImageBuild runs one build
  // on the request's thread, driving sandboxes and the store as a caller
  // would.
  void buildImage(http::Request& req, http::Response& res);
  friend class ImageBuild;
  // The node: its loader, cache and per-layer counters (api_node.cc).
  void getNode(http::Response& res);
  // GET /v1/metrics: opts_.registry rendered.
  void getMetrics(http::Response& res);
  // The platform's collector (api_node.cc): the cluster's figures, the API
  // errors, the records by state, the in-process node's and the run pool's.
  void writeMetrics(metrics::Writer& w);
  // Tenants, keys and quotas (api_tenants.cc): /v1/tenants... (admins only)
  // and /v1/whoami.
  void tenantsApi(const std::vector<std::string>& parts, http::Request& req, http::Response& res);
  void whoami(http::Response& res);
  nlohmann::json tenantToApi(const TenantRecord& t);
  // Whether the current caller may make this call at all, checked once for
  // every route before it is dispatched: admin-only collections
  // (kPermissionDenied), and another tenant's sandbox (kNotFound, as if it
  // did not exist).
  Status authorize(const std::vector<std::string>& parts, const std::string& method);
  // The image if the current caller may see it; kNotFound otherwise.
  Result<ImageRecord> visibleImage(const std::string& name, const std::string& tag);
  // Whether the current caller may stack layer `digest`: kNotFound (naming
  // `field`) when only images it cannot see name it.
  Status layerUsable(const std::string& digest, const std::string& field);
  // Whether the current caller may store image `img` (owner set): a user
  // tenant's images are private and named "<tenant>/..."; an empty
  // visibility becomes the caller's default (admin: public, user: private).
  Status mayWriteImage(ImageRecord& img);
  // Quota and rate admission of sandbox `r` for its owner; mu_ held.
  Status admitLocked(const SandboxRecord& r, const TenantRecord& owner);
  // A tenant's live sandboxes and runs under way (runsInFlight_); mu_ held.
  Usage usageLocked(const std::string& tenant) const;

 public:
  struct GcResult {
    std::vector<std::string> removed;  // blobs deleted
    // Data blobs that lost chunks (reclaimChunksLocked), and the bytes freed.
    std::vector<std::pair<std::string, int64_t>> reclaimed;
  };
  // Deletes layer blobs that no image names and no live sandbox stacks, once
  // they are older than graceS (an upload waits that long for its image),
  // with the data blobs only they name (as data or extra data), except data
  // blobs a converter holds (lookupChunkAndHold). Then, in the data blobs
  // kept only because other layers read some of their chunks, removes the
  // chunks none of them reads (reclaimChunksLocked). Thread-safe.
  Result<GcResult> collectGarbage(double graceS);

  // A hold on a data blob (as lookupChunkAndHold takes one), released when
  // this goes.
  class BlobHold {
   public:
    BlobHold(Platform* p, std::string digest) : p_(p), digest_(std::move(digest)) {}
    BlobHold(BlobHold&& o) noexcept : p_(std::exchange(o.p_, nullptr)), digest_(std::move(o.digest_)) {}
    BlobHold& operator=(BlobHold&&) = delete;
    ~BlobHold() {
      if (p_) p_->releaseChunkHolds({digest_});
    }

   private:
    Platform* p_;
    std::string digest_;
  };
  // Holds a built layer's data blob, then renames it and the metadata image
  // into the blob store under gcMu_ (so no collection decides about the
  // data blob in between); the hold lasts until the returned one goes: no
  // collection deletes the blob or removes chunks from it before the layer
  // naming it is recorded (linkBlob). A data blob an earlier collection left
  // partial (Store::setBlobReclaimed) is whole again and recorded so.
  Result<BlobHold> moveLayerIntoStore(const image::BuiltLayer& l);
  // Holds each of `layers` (holdBlob) for an image about to name them: no
  // collection, of this replica or another, deletes one until the image is
  // stored and the holds go. Take them before gcMu_, and check under gcMu_
  // that each is still stored.
  Result<std::vector<BlobHold>> holdLayers(const std::vector<std::string>& layers);

  // Chunks deduplicated across layers (Store::putChunks). A converter about
  // to store a chunk asks where it is already; on a hit it points its layer
  // at that data blob (an extra data blob, linkBlob) instead of storing it.
  // The blob found is held: collectGarbage will not delete it until the
  // converter calls releaseChunkHolds with it, which it does once linkBlob
  // has recorded the layer with its extra data (the layer then keeps the
  // blob), or when it gives the layer up. One release per hit. On a store
  // shared by replicas a blob held here is also held by a lease
  // ("chunk-hold:<blob>/<replica>", taken with the first hold, given up
  // with the last, lapsing after 6 h if this replica dies), which every
  // replica's collector checks.
  // nullopt: not stored anywhere (or its blob is being collected). Errors
  // are the store's. Thread-safe; never waits for a collection.
  Result<std::optional<ChunkLoc>> lookupChunkAndHold(const std::string& sha, int64_t length);
  // Releases one hold on each of `blobs` (each as returned in
  // ChunkLoc::data by lookupChunkAndHold; a blob not held is ignored).
  void releaseChunkHolds(const std::vector<std::string>& blobs);

 private:
  // Resolves "name[:tag]" or "sha256:…" to layers, checking they are of `kind`
  // (any kind when empty); `field` names the request field in errors.
  Result<std::vector<std::string>> resolveLayers(const std::string& ref, const std::string& kind,
                                                 const std::string& field);
  // Records an uploaded blob, and for a layer's metadata image its data blob
  // (kind set to "data", chunk index made) and the data blobs of other
  // layers its chunks point into, in EROFS device order (Store::setBlobExtraData).
  // Each extra must be stored already with kind "data" (kNotFound,
  // kFailedPrecondition), differ from `data` and the others, and needs a
  // `data` (kInvalidArgument); nothing is recorded when one fails.
  // `extraReads`: what the layer reads of each extra, in extraData's order
  // (BlobRecord::extraReads; empty when not known).
  Status linkBlob(const std::string& digest, int64_t size, const std::string& data,
                  const std::vector<std::string>& extraData = {},
                  const std::vector<image::BlockRanges>& extraReads = {});
  // Deletes blob `digest` (row, file, chunk index) unless a converter holds
  // it: its chunk rows go first, then the holds are checked (collectGarbage
  // says why in that order). Whether it was deleted. gcMu_ held.
  // `dataBlob`: a layer's data blob (else a layer): what a shared store is
  // asked under the claim (a layer naming it, or an image naming it).
  Result<bool> deleteBlobUnlessHeld(const std::string& digest, bool dataBlob);
  // Takes one hold on data blob `data` (lookupChunkAndHold's, with its lease
  // on a shared store).
  Status holdBlob(const std::string& data);
  // Whether a converter of this replica or (shared store) another holds `data`.
  Result<bool> blobHeld(const std::string& data);
  // On a store shared by replicas, a collector about to delete `data` or
  // punch chunks out of it takes its lease first ("blob-collect:<blob>");
  // holdBlob waits while one is live. false: another replica has it.
  Result<bool> beginCollect(const std::string& data);
  void endCollect(const std::string& data);
  // A collector's claim on a blob: its collection lease with no hold live
  // (so none can start); the lease ends when the claim goes.
  class CollectClaim {
   public:
    CollectClaim(Platform* p, std::string digest) : p_(p), digest_(std::move(digest)) {}
    CollectClaim(CollectClaim&& o) noexcept
        : p_(std::exchange(o.p_, nullptr)), digest_(std::move(o.digest_)) {}
    CollectClaim& operator=(CollectClaim&&) = delete;
    ~CollectClaim() {
      if (p_) p_->endCollect(digest_);
    }

   private:
    Platform* p_;
    std::string digest_;
  };
  // nullopt: another replica's collector is at it, or a converter holds it.
  Result<std::optional<CollectClaim>> claimForCollection(const std::string& digest);
  // The file of blob `digest` was just replaced by its whole bytes: forgets
  // what an earlier collection reclaimed of it. gcMu_ held.
  Status markBlobWholeLocked(const std::string& digest);
  // collectGarbage's chunk pass over `blobs` (the store's, after deletions):
  // a data blob no stored layer has as its own data, older than graceS and
  // not held, loses (holes punched, Store::setBlobReclaimed) every chunk
  // that no layer naming it as an extra reads (BlobRecord::extraReads; a
  // reader whose reads are not recorded keeps the whole blob). Its chunk rows
  // for those chunks go first, then the collection lease is taken and the
  // holds are checked, as for a delete; then the blob and the layers naming
  // it are read again (another replica may have linked one since `blobs`
  // was listed), and only chunks still unread whose rows went are punched.
  // gcMu_ held.
  Result<std::vector<std::pair<std::string, int64_t>>> reclaimChunksLocked(
      const std::vector<BlobRecord>& blobs, double graceS);
  // Digests of layers stacked by sandboxes that are not stopped or failed.
  std::set<std::string> layersInUse();

  // The sandbox if it runs, after resuming it if it was paused; counts as a
  // call for its idle timers.
  Result<SandboxRecord> runningSandbox(const std::string& id);
  // Stops a sandbox for good and returns its final record. Waits out a
  // create or destroy already in progress instead of failing.
  Result<SandboxRecord> destroy(const std::string& id, SandboxState finalState,
                                const std::string& why);
  void onSandboxDeath(const std::string& id, const std::string& why);
  // Nodes (platform_nodes.cc): a sandbox whose node went down is `lost`, and
  // `running` again when the node returns with it.
  void onSandboxLost(const std::string& id, bool lost, const std::string& why);
  // start(): a live or lost record of a remote node carries on as recorded
  // (its node reconciles when it heartbeats); false for other records.
  bool bindRemote(const SandboxRecord& r);
  // The request's "pool" and "spread" into r.
  static Status parsePlacement(const nlohmann::json& j, SandboxRecord& r);
  // Replicas (platform_nodes.cc), for a shared store: records other replicas
  // wrote come into sandboxes_. refreshSandbox re-reads one (before a call on
  // it); syncSandboxes reads those changed since the last sync; applyStoredLocked
  // (mu_ held) takes a stored record unless the cached one is newer or in a
  // change this replica is making; reapCreating (leader) fails records left
  // `creating` by a replica that died.
  void refreshSandbox(const std::string& id, bool missingOnly = false);
  void syncSandboxes();
  void applyStoredLocked(const SandboxRecord& r);
  // `candidates`: the records the janitor's walk found `creating` by another replica.
  void reapCreating(const std::vector<std::string>& candidates);
  // Batch claims (replicas, docs/batches.md): the store's lease "batch:<id>",
  // held by the replica creating the batch's sandboxes (its replica id, so
  // the same replica restarted takes it back at once). Taken before a batch
  // is stored, renewed by the janitor while the batch runs here, released
  // when it ends; a replica that starts resumes a batch's pending records
  // only if it wins the claim (a compare-and-set in the store), so two
  // replicas never both create one batch's sandboxes.
  static constexpr double kBatchClaimTtlS = 10;
  Result<bool> claimBatch(const std::string& id);
  void renewBatchClaims();
  // Idle timers across replicas: shareCalls writes the calls seen here (of
  // sandboxes with idle_timeout_s or auto_pause_s) to the store, at most one
  // a second per sandbox; dropCalledElsewhere (leader) takes from the
  // candidates those called through another replica meanwhile.
  void shareCalls();
  void dropCalledElsewhere(std::vector<std::string>& idle, std::vector<std::string>& toPause);
  bool isLeader() const { return !opts_.leader || opts_.leader(); }
  // dsec_sandboxes: the records by state, every state but pending listed.
  void writeSandboxStateMetrics(metrics::Writer& w);
  void janitor();
  static constexpr size_t kJanitorSlice = 4096;  // records per hold of mu_
  static constexpr double kFullWalkS = 5;        // the janitor's walk over every record
  // Records with a timer, which the janitor looks at each second; all
  // records only every kFullWalkS (purges, other replicas' creates, and any
  // timer missed here). mu_ held. A TTL goes into expiry_ by when it ends, so
  // a second costs the TTLs ending, not every record with one (with the
  // default TTL, every record: walking 380,000 of them each second was a
  // fifth of the platform's CPU at that size). An idle timeout or auto-pause
  // moves with every call, so those records are looked at each second (timed_).
  void indexLocked(const SandboxRecord& r) {
    if (r.expiresAt > 0) expiry_.emplace(r.expiresAt, r.id);
    if (r.idleTimeoutS > 0 || r.autoPauseS > 0) timed_.insert(r.id);
  }
  using Deadline = std::pair<double, std::string>;  // (when, sandbox id)
  // Earliest first; an entry whose record is gone or final is dropped when it
  // comes up. Guarded by mu_.
  std::priority_queue<Deadline, std::vector<Deadline>, std::greater<Deadline>> expiry_;
  std::set<std::string> timed_;  // guarded by mu_

  PlatformOptions opts_;
  Store* store_ = nullptr;     // not owned
  std::unique_ptr<Policies> policies_;
  std::unique_ptr<Chronus> chronus_;
  // E2B's polled watchers by id (api_e2b_envd.cc); lock order: this, then mu_.
  std::mutex e2bWatchersMu_;
  std::map<std::string, std::shared_ptr<E2bWatcher>> e2bWatchers_;
  // Process sessions by sandbox (processes.h).
  std::unique_ptr<ProcessTable> processes_ = std::make_unique<ProcessTable>();
  // Exposed ports: the listener's URL (mu_), the earliest ttl end (mu_), and
  // the proxy's options (set at start).
  std::string listenUrl_;
  double nextPortExpiry_ = std::numeric_limits<double>::infinity();
  std::shared_ptr<const http::ProxyOptions> proxyOpts_;
  metrics::CounterVec portResponses_;  // by status code
  std::unique_ptr<MetricsHistory> history_;
  std::unique_ptr<Tenants> tenants_;
  std::mutex tenantsMu_;        // serializes changes to tenants (api_tenants.cc)
  Cluster* cluster_ = nullptr;  // not owned: the nodes, and the router to them
  std::unique_ptr<RunPool> runPool_;  // fncall one-shot calls (api_run.cc)
  std::unique_ptr<PullManager> pulls_;  // registry pulls (api_pull.cc)
  uint64_t metricsId_ = 0;            // the collector in opts_.registry (0: none yet)
  std::mutex gcMu_;  // one collection at a time; held while images and layers are deleted
  // Data blobs converters are about to point chunks into
  // (lookupChunkAndHold), one entry per hold. Taken alone or under gcMu_,
  // never the other way round.
  std::mutex chunkHoldMu_;
  std::multiset<std::string> chunkHolds_;  // guarded by chunkHoldMu_
  // The chunk table's keys (chunk_keys.h): loaded from the store at start on
  // a thread of its own, added to by storeConvertedLayer's putChunks; a
  // lookup of a chunk not in it costs no store query (lookupChunkAndHold).
  // Thread-safe on its own. Its destructor stops the load, before store_ goes.
  ChunkKeys chunkKeys_;

  std::mutex mu_;  // guards sandboxes_, deleteRequested_, stopping_
  std::map<std::string, SandboxRecord> sandboxes_;
  int orphanSandboxes_ = 0;  // set in start(): sandboxes the edge ran that no record owned
  std::map<std::string, double> lastCall_;  // guarded by mu_: for idle timeouts and auto-pause
  // Calls to a sandbox still being answered (an exec that runs for minutes
  // keeps its sandbox awake however short its idle timeout); guarded by mu_.
  std::map<std::string, int> callsInFlight_;
  // POST /v1/run calls under way, per tenant (runs, cpu, memory_mb); guarded by mu_.
  std::map<std::string, Usage> runsInFlight_;
  // Sandboxes asked to stop while still being created; createSandbox honours it.
  std::set<std::string> deleteRequested_;
  bool stopping_ = false;
  std::condition_variable stateCv_;  // a record reached a final state or went away
  std::mutex shutdownMu_;  // serializes shutdown()
  // Chronus' state beyond the step log: guards trajectories_ (a cache of the
  // store's TrajectoryRecords without their sandboxDoc), recovering_ (one
  // recover per trajectory at a time) and stepBytesPinned_.
  std::mutex trajMu_;
  std::map<std::string, TrajectoryRecord> trajectories_;
  // Answers replayed from the log since this replica started, per
  // trajectory and step (trajMu_): GET /v1/trajectories/{id}/info.
  std::map<std::string, std::map<int64_t, int64_t>> replays_;
  std::set<std::string> recovering_;
  std::multiset<std::string> stepBytesPinned_;
  std::condition_variable janitorCv_;
  std::thread janitorThread_;
  // Batches (api_batches.cc). batchMu_ guards batches_, batchQueue_,
  // batchDone_ and batchStop_; taken before mu_ when both are held.
  struct Batch {
    BatchRecord rec;
    std::vector<std::string> ids;  // its sandboxes (pending ones renamed on restart)
    int64_t outstanding = 0;       // not yet created or failed
    int64_t created = 0, failed = 0;  // outcomes stored so far
    std::map<std::string, int64_t> errors;  // failures by code
    bool mine = true;      // this replica creates its sandboxes (else another's claim)
    bool claimed = false;  // this replica holds its claim in the store (shared stores)
  };
  std::mutex batchMu_;
  std::map<std::string, Batch> batches_;
  std::deque<std::string> batchQueue_;   // sandbox ids to create
  std::vector<SandboxRecord> batchDone_;  // created or failed on a node, to store
  bool batchStop_ = false;
  std::condition_variable batchCv_;   // work queued, or stopping
  std::condition_variable commitCv_;  // batchDone_ grew, or stopping
  std::vector<std::thread> batchThreads_;
  int batchIdle_ = 0;            // workers waiting for work (batchMu_)
  int batchWorkersStarted_ = 0;  // workers started so far (batchMu_)
  std::mutex syncMu_;      // one syncSandboxes at a time; guards syncSince_
  double syncSince_ = 0;  // the store's clock at the last sync
  std::map<std::string, double> sharedCalls_;  // janitor thread only: last call time shared
  // Whether another replica held a live lease at the last sync: alone, a
  // replica re-reads a record only when it has none (no cost per call).
  std::atomic<bool> othersAlive_{true};
};

// Helpers shared by the api_*.cc files.
void sendError(http::Response& res, const Status& st);
// The same for a deferred response (an exec completed later).
void sendError(http::Deferred& d, const Status& st);
// The API's answer to an error: its HTTP status and JSON body, counted.
std::pair<int, std::string> errorAnswer(const Status& st);
// The JSON body alone, {"error": {"code", "message", "field"?}}, not counted
// (the answers of exposed ports' proxy, which are not API calls).
std::string errorBody(const Status& st);
void sendJson(http::Response& res, int status, const std::string& body);
// An image as the API shows it (api_images.cc).
nlohmann::json imageToApi(const ImageRecord& r);
void sendJson(http::Deferred& d, int status, const std::string& body);
// The in-process node's figures (api_node.cc): its layers, cache, denials,
// leftovers removed (`orphanSandboxes` added to the node's own count of
// sandboxes) and sandboxes re-adopted.
void writeNodeMetrics(const proto::NodeReport& node, int orphanSandboxes, metrics::Writer& w);
// A sandbox as the API shows it.
nlohmann::json sandboxToApi(const SandboxRecord& r);
// Parses "name[:tag]"; the tag defaults to "latest".
Status parseImageRef(const std::string& ref, std::string& name, std::string& tag);

}  // namespace dsec::platform
