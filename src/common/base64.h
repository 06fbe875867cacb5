// Standard base64 with padding. In dsec_core, so the static agent has it too.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace dsec {

std::string base64Encode(std::string_view in);
// kInvalidArgument on characters outside the standard alphabet or bad padding.
Result<std::string> base64Decode(std::string_view in);

}  // namespace dsec
