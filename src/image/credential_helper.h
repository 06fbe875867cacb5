// Docker credential helpers: the programs `docker-credential-<name>` a Docker
// config.json names in "credHelpers" (per registry) or "credsStore" (for all),
// which keep credentials in a keychain instead of the file. `dsec image pull`
// and `dsec image build` use them as the Docker CLI does.
//
//   auto helper = credentialHelperFor(configText, "ghcr.io");  // "pass", "ecr-login", ...
//   if (helper.isOk() && *helper) creds = runCredentialHelper(**helper, "ghcr.io");
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"
#include "image/registry_client.h"

namespace dsec::image {

// The helper the config names for registry `host`: "credHelpers"[host] (keys
// as credentialsFromDockerConfig matches "auths" keys), else "credsStore";
// nullopt when neither. kInvalidArgument (field "auth") for JSON that does not
// parse or a helper name that is not a plain word ([A-Za-z0-9._-]+).
Result<std::optional<std::string>> credentialHelperFor(std::string_view configJson,
                                                       std::string_view host);

// Runs `docker-credential-<name> get` (from $PATH) with the registry's server
// address on stdin ("https://index.docker.io/v1/" for Docker Hub, else the
// host) and reads {"Username", "Secret"} from its stdout; a Username of
// "<token>" makes Secret an identity token. nullopt when the helper has none
// for it (it exits non-zero saying "credentials not found"). Errors (field
// "auth"): kNotFound when the helper is not on $PATH; kUnavailable when it
// fails otherwise, runs longer than timeoutS or answers other than that JSON
// (the message quotes at most its first line of error output, never its
// answer).
Result<std::optional<RegistryCredentials>> runCredentialHelper(const std::string& name,
                                                               std::string_view host,
                                                               double timeoutS = 30);

}  // namespace dsec::image
