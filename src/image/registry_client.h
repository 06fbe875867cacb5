// A client of the OCI Distribution API v2 (the protocol of Docker Hub, GHCR,
// Quay, Harbor, ECR and the CNCF distribution server): resolves a reference to
// one platform's manifest and config, and downloads blobs verified against
// their digests. libcurl underneath (TLS with the system CAs or a given
// bundle, redirects to blob storage, Range requests).
//
// Security: credentials (and bearer tokens) go only to the registry's own
// origin (scheme, host, port) and its token realm; a redirect elsewhere (blob
// storage) is followed without the Authorization header, and credentials are
// never sent over plain http unless the host is one of insecureHosts. A
// request made over https never follows a redirect to plain http, unless the
// redirect's host is one of insecureHosts (kPermissionDenied, field "ref",
// naming it). Nothing is read past the size its descriptor declares (the
// config, a manifest an index points at, a layer). Neither credentials nor
// tokens appear in an error message or a log line.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace dsec::image {

// A registry reference, normalised as Docker does:
//   "debian"                     -> docker.io / library/debian : latest
//   "ghcr.io/a/b:1"              -> ghcr.io / a/b : 1
//   "127.0.0.1:5000/x@sha256:.." -> 127.0.0.1:5000 / x, digest
//   "localhost/x"                -> localhost / x : latest
// The first path component is a host when it contains '.' or ':' or is
// "localhost". Repository components are [a-z0-9]+ separated by ".", "_",
// "__" or "-"+; tags [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}; digests
// "sha256:<64 lower hex>" (other algorithms are refused). Hosts are
// domain names or IPv4 (or a bracketed IPv6) with an optional :port;
// "index.docker.io" is written "docker.io"; "docker.io/x" is
// "docker.io/library/x". A reference with neither tag nor digest gets tag
// "latest"; one with both keeps both (the digest is what is fetched).
struct RegistryRef {
  std::string host;        // as written, lower-cased ("docker.io" for Docker Hub)
  std::string repository;  // "library/debian"
  std::string tag;         // "" when the reference has only a digest
  std::string digest;      // "sha256:<hex>" or ""
  // Where requests go: "registry-1.docker.io" for "docker.io", else host.
  std::string apiHost() const;
  // "host/repository[:tag][@digest]".
  std::string str() const;
};
// kInvalidArgument, field "ref", naming what is wrong.
Result<RegistryRef> parseRegistryRef(std::string_view text);

// "os/arch[/variant]", e.g. "linux/amd64", "linux/arm64/v8". Parsing lower-cases
// and normalises as containerd does: x86_64 and x86-64 -> amd64, aarch64 ->
// arm64, armhf -> arm/v7, armel -> arm/v6, plain arm -> arm/v7.
//
// Matching a manifest list entry: os and architecture equal (after the same
// normalisation); variants equal, except that arm64 "" and "v8" are the same
// and that amd64 asked with no variant takes any variant.
struct ImagePlatform {
  std::string os = "linux";
  std::string architecture = "amd64";
  std::string variant;
  std::string str() const;
};
// kInvalidArgument, field "platform".
Result<ImagePlatform> parseImagePlatform(std::string_view text);

struct RegistryCredentials {
  std::string username;
  std::string password;
  std::string identityToken;  // config.json "identitytoken": an OAuth2 refresh token
};

// Looks up credentials for `host` (as in the reference; "docker.io" also
// matches "https://index.docker.io/v1/") in the text of a Docker-style
// config.json ("auths": {"host": {"auth": base64(user:pass)} or username and
// password, "identitytoken"}). Keys may be written "host", "https://host" or
// "https://host/v1/" (scheme and path are ignored); an exact key wins. nullopt
// when it names none, or only an empty entry (credentials kept by a
// credsStore helper: credential_helper.h runs those). kInvalidArgument (field
// "auth") for malformed JSON or auth; the message never quotes a secret.
// Of the keys of a Docker config's "auths" or "credHelpers", the one for
// registry `host`: an exact match, else the first naming it once scheme and
// path are dropped ("https://host/v1/"), case-insensitively; for docker.io,
// "index.docker.io" and "registry-1.docker.io" after it. nullopt: none.
std::optional<std::string> dockerConfigKeyFor(const std::vector<std::string>& keys,
                                              std::string_view host);

Result<std::optional<RegistryCredentials>> credentialsFromDockerConfig(std::string_view json,
                                                                       std::string_view host);

// One challenge of a WWW-Authenticate header (RFC 7235): scheme lower-cased,
// auth-param names lower-cased, quoted-string values unquoted (so
// scope="repository:a:pull,push" keeps its comma). token68 holds a token68
// form ("Negotiate abc=="), which registries do not use.
struct AuthChallenge {
  std::string scheme;
  std::map<std::string, std::string> params;
  std::string token68;
};
// Every challenge in the header value, in order; malformed parts are skipped.
std::vector<AuthChallenge> parseWwwAuthenticate(std::string_view header);

enum class LayerCompression { kNone, kGzip, kZstd };

struct RegistryLayer {
  std::string digest;  // "sha256:<hex>" of the blob as stored (compressed)
  int64_t size = 0;    // its length per the manifest
  std::string mediaType;
  LayerCompression compression = LayerCompression::kNone;  // from the media type
};

struct ResolvedImage {
  RegistryRef ref;
  std::string indexDigest;  // the index or manifest list's digest; "" if none
  std::string manifestDigest;
  std::string manifestMediaType;
  std::string manifest;  // the manifest's bytes, verified against manifestDigest
  // Of the manifest chosen, "linux/amd64": from the index entry, or, for a
  // reference naming a single manifest, from its config (that manifest is
  // taken whatever its platform: the caller compares if it cares).
  std::string platform;
  std::string configDigest;
  std::string config;                 // the config blob's bytes, verified
  std::vector<RegistryLayer> layers;  // bottom first
};

struct RegistryOptions {
  // Hosts (as written in references, with port) reached over plain http; for
  // every other host https. Also where a token realm may get credentials over
  // plain http.
  std::vector<std::string> insecureHosts;
  std::string caFile;  // PEM bundle trusted instead of the system's ("" = system)
  std::optional<RegistryCredentials> credentials;  // for every host this client talks to
  // Per request, the first included. Transient failures are retried: a
  // connection refused or reset, a timeout or stall, a cut transfer, 408, 429
  // and 5xx. fetchBlob resumes each retry from the bytes it has, and an
  // attempt that added bytes to the spool does not count against the limit.
  int attempts = 5;
  double backoffS = 0.2;  // doubles each retry (with jitter), capped at 5 s
  double connectTimeoutS = 10;
  double stallTimeoutS = 30;  // a transfer moving < 1 KB/s this long is aborted
  int64_t maxManifestBytes = 4 << 20;
  int64_t maxConfigBytes = 8 << 20;
  // When set, every connection (to the registry, its token realm, blob
  // storage it redirects to) is made only to addresses it accepts; others
  // fail with kPermissionDenied (field "ref"). The platform refuses
  // loopback, private and link-local addresses for tenants' pulls, so a
  // registry reference cannot reach the platform's own network.
  std::function<bool(const ::sockaddr*)> allowAddress;
};

// Thread-safe: one client may serve several concurrent downloads (bearer
// tokens are cached per realm, service and scope, and reused until 90% of
// their expires_in, default 60 s; a token refused with 401 is fetched anew
// once). Authentication: a request goes first without credentials, or with
// those the registry asked of this repository before; a 401 names a Bearer
// challenge (a token is fetched from its realm: GET with Basic credentials,
// or a POST of the identity token as an OAuth2 refresh token) or a Basic one
// (the credentials are sent as they are).
class RegistryClient {
 public:
  explicit RegistryClient(RegistryOptions opts);
  ~RegistryClient();

  // Fetches the manifest (following an index or manifest list to the one for
  // `platform`), checks every digest it can (the reference's, the
  // Docker-Content-Digest header, the config blob's), and fetches the config.
  // Errors (field in parentheses):
  //   kNotFound (ref): no such repository, tag or digest; (platform): the
  //     index has no manifest for the platform (the message lists those it has)
  //   kUnauthenticated (auth): credentials needed or refused
  //   kPermissionDenied (auth): authenticated but not allowed to pull
  //   kInvalidArgument (ref): schema 1 or an unknown manifest media type, an
  //     index inside an index, a config that is not an image config, a
  //     foreign or non-distributable layer (or one with "urls"), a layer
  //     media type not understood, a malformed manifest or digest; other
  //     4xx answers are kFailedPrecondition with the registry's message
  //   kDataLoss (ref): a manifest or config whose bytes fail their digest
  //     (the reference's, Docker-Content-Digest's, the index entry's), or
  //     longer than the size the index or manifest declares (the transfer
  //     is cut as soon as it passes it; the message names the digest)
  //   kPayloadTooLarge (ref): a manifest or config over its cap
  //   kUnavailable: the registry unreachable, 5xx, or TLS failure, once the
  //     attempts are spent (the message names host and cause)
  //   kPermissionDenied (ref): a redirect from https to plain http; an
  //     address allowAddress refuses
  // An error the bearer token service (the challenge's realm) caused names
  // that service's URL and host, not the registry's: kUnauthenticated (auth)
  // for a 401 or an answer without a token, kPermissionDenied (auth) for a
  // 403, kUnavailable for 408, 429 and 5xx, kUnauthenticated (auth) for any
  // other status.
  Result<ResolvedImage> resolve(const RegistryRef& ref, const ImagePlatform& platform);

  // HEAD of a blob with this client's credentials: OK when it exists and may
  // be read, that is when the answer, after redirects followed as
  // fetchBlob's are (to blob storage, without the Authorization header), is
  // 2xx; a 3xx alone proves nothing. Storage that refuses HEAD with a 4xx
  // other than 404 and 410 (a URL presigned for GET only) is asked for the
  // blob's first byte instead (GET, Range bytes=0-0). Errors as resolve's,
  // naming the server that answered; kInvalidArgument (ref) for a digest not
  // "sha256:<64 hex>".
  Status checkBlob(const RegistryRef& ref, const std::string& digest);

  // Downloads blob `layer.digest` of `ref`'s repository into `spoolPath`,
  // appending: if the file exists, asks only for the bytes after its length
  // (Range), as again after a transfer cut mid-way. Verifies the sha256 of the
  // whole file against the digest and the length against layer.size.
  // layer.size is also a hard cap: the transfer is cut as soon as the spool
  // would pass it (kDataLoss naming the digest, the spool deleted), so a
  // registry cannot fill the disk before the digest is checked. There is no
  // unknown-size mode: resolve refuses a layer without a size and a negative
  // one here is kInvalidArgument, so no download is unbounded.
  // A 200 answer to a Range request restarts the spool from empty, as does a
  // spool longer than layer.size. A 206 may hold a part only, and its
  // Content-Range total may be "*" (unknown): if it starts at the spool's
  // length, its bytes are kept and the rest asked for at once; one starting
  // elsewhere restarts the spool. The spool is fsynced before OK.
  // `progress(bytesInFile)` is called as bytes land (after they are written),
  // on the calling thread, and once first with what a resumed spool holds.
  // `cancel` is checked as bytes arrive, while waiting for them and between
  // retries. Redirects (to blob storage) are followed without the
  // Authorization header when they leave the registry.
  // Returns when done, when `cancel` turns true (kUnavailable, "cancelled";
  // the spool is kept for a later resume), or on error:
  //   kInvalidArgument (ref): layer.digest not "sha256:<64 hex>", or a
  //     negative layer.size
  //   kDataLoss: the bytes fail the digest, or the length is not layer.size
  //     (more bytes than that, or a 200 or a 206 whose total says fewer; the
  //     spool is deleted)
  //   kNotFound, kUnauthenticated, kPermissionDenied: as resolve's
  //     (kPermissionDenied (ref) for a redirect from https to plain http)
  //   kUnavailable: retries spent (the spool is kept)
  //   errno-carrying codes (sysError) for the spool's own I/O
  Status fetchBlob(const RegistryRef& ref, const RegistryLayer& layer, const std::string& spoolPath,
                   const std::function<void(int64_t)>& progress = {},
                   const std::atomic<bool>* cancel = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsec::image
