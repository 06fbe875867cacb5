#include "common/json_writer.h"

#include <charconv>
#include <cmath>

namespace dsec {

namespace {

// The UTF-8 sequence at s[i] (Unicode 15, table 3-7): its length when it is
// well-formed (*ok true); else the length of its maximal subpart (at least 1),
// the bytes one U+FFFD replaces (as nlohmann's error_handler_t::replace does).
size_t utf8Sequence(std::string_view s, size_t i, bool* ok) {
  unsigned c = static_cast<unsigned char>(s[i]);
  size_t n = 0;
  unsigned lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  }
  *ok = false;
  if (n == 0) return 1;
  for (size_t k = 1; k < n; ++k) {
    if (i + k >= s.size()) return k;
    unsigned b = static_cast<unsigned char>(s[i + k]);
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return k;
  }
  *ok = true;
  return n;
}

}  // namespace

void appendJsonString(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out.push_back('"');
  size_t plain = 0;  // start of the bytes not yet copied
  for (size_t i = 0; i < s.size();) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c != '"' && c != '\\' && c < 0x80) {
      ++i;
      continue;
    }
    bool ok = false;
    size_t n = c < 0x80 ? 1 : utf8Sequence(s, i, &ok);
    if (ok) {
      i += n;
      continue;
    }
    out.append(s.data() + plain, i - plain);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out.push_back(kHex[c >> 4]);
          out.push_back(kHex[c & 15]);
        } else {
          out += "\xEF\xBF\xBD";  // not well-formed UTF-8: U+FFFD
          i += n - 1;
        }
    }
    plain = ++i;
  }
  out.append(s.data() + plain, s.size() - plain);
  out.push_back('"');
}

void JsonWriter::comma() {
  if (!first_) out_.push_back(',');
  first_ = false;
}

JsonWriter& JsonWriter::beginObject() {
  comma();
  out_.push_back('{');
  first_ = true;
  return *this;
}

JsonWriter& JsonWriter::endObject() {
  out_.push_back('}');
  first_ = false;
  return *this;
}

JsonWriter& JsonWriter::beginArray() {
  comma();
  out_.push_back('[');
  first_ = true;
  return *this;
}

JsonWriter& JsonWriter::endArray() {
  out_.push_back(']');
  first_ = false;
  return *this;
}

JsonWriter& JsonWriter::key(std::string_view k) {
  comma();
  appendJsonString(out_, k);
  out_.push_back(':');
  first_ = true;  // the value that follows takes no comma
  return *this;
}

JsonWriter& JsonWriter::value(std::string_view s) {
  comma();
  appendJsonString(out_, s);
  return *this;
}

JsonWriter& JsonWriter::value(bool b) {
  comma();
  out_ += b ? "true" : "false";
  return *this;
}

JsonWriter& JsonWriter::value(int64_t v) {
  comma();
  char buf[24];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  out_.append(buf, r.ptr);
  return *this;
}

JsonWriter& JsonWriter::value(double v) {
  if (!std::isfinite(v)) return null();
  comma();
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest exact round trip
  std::string_view s(buf, size_t(r.ptr - buf));
  out_ += s;
  // Whole numbers keep a fraction, so they read back as doubles.
  if (s.find_first_of(".e") == std::string_view::npos) out_ += ".0";
  return *this;
}

JsonWriter& JsonWriter::null() {
  comma();
  out_ += "null";
  return *this;
}

JsonWriter& JsonWriter::value(const std::vector<std::string>& v) {
  beginArray();
  for (auto& s : v) value(s);
  return endArray();
}

JsonWriter& JsonWriter::value(const std::map<std::string, std::string>& m) {
  beginObject();
  for (auto& [k, v] : m) key(k).value(v);
  return endObject();
}

}  // namespace dsec
