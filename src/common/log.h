// Minimal leveled logging to stderr, one line per call, thread-safe.
#pragma once

#include <string_view>

namespace dsec::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void setLevel(Level level);
Level level();
void write(Level level, std::string_view msg);

inline void debug(std::string_view m) { if (level() <= Level::kDebug) write(Level::kDebug, m); }
inline void info(std::string_view m) { write(Level::kInfo, m); }
inline void warn(std::string_view m) { write(Level::kWarn, m); }
inline void error(std::string_view m) { write(Level::kError, m); }

}  // namespace dsec::log
