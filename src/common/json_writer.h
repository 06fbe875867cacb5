// A JSON text writer for hot paths: appends to one string, no document tree.
// nlohmann::json builds a tree of allocated nodes and then prints it; for a
// record written hundreds of thousands of times (the platform's sandbox
// records, docs/cluster.md "Measured") that was most of the cost of storing
// it. The output parses with nlohmann::json to what its dump() would give:
// strings are escaped as JSON requires (invalid UTF-8 becomes U+FFFD, as
// with nlohmann's error_handler_t::replace), doubles are written in the
// shortest form that reads back exactly ("1.0" for whole numbers, null for
// NaN and infinities).
//
// Not thread-safe; the caller places keys and commas through the methods,
// which keep track of them: key() before each member of an object.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace dsec {

class JsonWriter {
 public:
  explicit JsonWriter(std::string& out) : out_(out) {}

  JsonWriter& beginObject();
  JsonWriter& endObject();
  JsonWriter& beginArray();
  JsonWriter& endArray();
  // The name of the next member of the current object.
  JsonWriter& key(std::string_view k);

  JsonWriter& value(std::string_view s);
  JsonWriter& value(const char* s) { return value(std::string_view(s)); }
  JsonWriter& value(const std::string& s) { return value(std::string_view(s)); }
  JsonWriter& value(bool b);
  JsonWriter& value(int64_t v);
  JsonWriter& value(int v) { return value(int64_t(v)); }
  JsonWriter& value(double v);
  JsonWriter& null();
  JsonWriter& value(const std::vector<std::string>& v);
  JsonWriter& value(const std::map<std::string, std::string>& m);

  // key(k).value(v) in one call.
  template <typename T>
  JsonWriter& member(std::string_view k, const T& v) {
    return key(k).value(v);
  }

 private:
  void comma();
  void string(std::string_view s);

  std::string& out_;
  bool first_ = true;  // no member or element yet at this level
};

// The JSON string literal of s ("..." with escapes), appended to out.
void appendJsonString(std::string& out, std::string_view s);

}  // namespace dsec
