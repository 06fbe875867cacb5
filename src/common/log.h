// Minimal leveled logging, one line per call, thread-safe. Lines go to stderr,
// or to a file that is rotated (one older copy, `<path>.1`) once it passes a
// size, so a busy node's log stays bounded on disk. Past kMaxLinesPerSecond a
// second the rest are dropped and counted in a line of their own: a flood of
// warnings cannot fill the disk or stall the threads that log.
#pragma once

#include <string>
#include <string_view>

namespace dsec::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

constexpr int kMaxLinesPerSecond = 1000;

void setLevel(Level level);
// Logs to `path` (appending) from now on, rotating it to `path.1` past
// maxBytes; false (and stderr kept) if it cannot be opened.
bool setFile(const std::string& path, long long maxBytes);
Level level();
void write(Level level, std::string_view msg);

inline void debug(std::string_view m) { if (level() <= Level::kDebug) write(Level::kDebug, m); }
inline void info(std::string_view m) { write(Level::kInfo, m); }
inline void warn(std::string_view m) { write(Level::kWarn, m); }
inline void error(std::string_view m) { write(Level::kError, m); }

}  // namespace dsec::log
