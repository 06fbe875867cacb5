#include "edge/backends/vm/vm_input.h"

#include <cctype>
#include <map>

#include "common/util.h"

namespace dsec::edge::vminput {

using json = nlohmann::json;

namespace {

json keyEvent(const std::string& qcode, bool down) {
  return {{"type", "key"},
          {"data", {{"down", down}, {"key", {{"type", "qcode"}, {"data", qcode}}}}}};
}

// US layout: the unshifted key of each printable character, and whether
// shift is needed.
bool charKey(char c, std::string* qcode, bool* shift) {
  static const std::map<char, std::pair<const char*, bool>> kPunct = {
      {' ', {"spc", false}},          {'\n', {"ret", false}},        {'\t', {"tab", false}},
      {'-', {"minus", false}},        {'_', {"minus", true}},        {'=', {"equal", false}},
      {'+', {"equal", true}},         {'[', {"bracket_left", false}}, {'{', {"bracket_left", true}},
      {']', {"bracket_right", false}}, {'}', {"bracket_right", true}}, {';', {"semicolon", false}},
      {':', {"semicolon", true}},     {'\'', {"apostrophe", false}}, {'"', {"apostrophe", true}},
      {'`', {"grave_accent", false}}, {'~', {"grave_accent", true}}, {'\\', {"backslash", false}},
      {'|', {"backslash", true}},     {',', {"comma", false}},       {'<', {"comma", true}},
      {'.', {"dot", false}},          {'>', {"dot", true}},          {'/', {"slash", false}},
      {'?', {"slash", true}},         {'!', {"1", true}},            {'@', {"2", true}},
      {'#', {"3", true}},             {'$', {"4", true}},            {'%', {"5", true}},
      {'^', {"6", true}},             {'&', {"7", true}},            {'*', {"8", true}},
      {'(', {"9", true}},             {')', {"0", true}}};
  if (c >= 'a' && c <= 'z') {
    *qcode = std::string(1, c);
    *shift = false;
    return true;
  }
  if (c >= 'A' && c <= 'Z') {
    *qcode = std::string(1, char(c - 'A' + 'a'));
    *shift = true;
    return true;
  }
  if (c >= '0' && c <= '9') {
    *qcode = std::string(1, c);
    *shift = false;
    return true;
  }
  auto it = kPunct.find(c);
  if (it == kPunct.end()) return false;
  *qcode = it->second.first;
  *shift = it->second.second;
  return true;
}

const std::map<std::string, std::string>& aliases() {
  static const std::map<std::string, std::string> k = {
      {"enter", "ret"},       {"return", "ret"},        {"space", "spc"},
      {"escape", "esc"},      {"control", "ctrl"},      {"lctrl", "ctrl"},
      {"rctrl", "ctrl_r"},    {"rshift", "shift_r"},    {"ralt", "alt_r"},
      {"super", "meta_l"},    {"win", "meta_l"},        {"meta", "meta_l"},
      {"cmd", "meta_l"},      {"del", "delete"},        {"pageup", "pgup"},
      {"pagedown", "pgdn"},   {"page_up", "pgup"},      {"page_down", "pgdn"},
      {"ins", "insert"},      {"bksp", "backspace"},    {"arrowup", "up"},
      {"arrowdown", "down"},  {"arrowleft", "left"},    {"arrowright", "right"},
      {"capslock", "caps_lock"}, {"printscreen", "print"}};
  return k;
}

bool knownQcode(const std::string& k) {
  static const char* const kNames[] = {
      "shift", "shift_r", "alt", "alt_r", "ctrl", "ctrl_r", "menu", "esc", "minus", "equal",
      "backspace", "tab", "bracket_left", "bracket_right", "ret", "semicolon", "apostrophe",
      "grave_accent", "backslash", "comma", "dot", "slash", "asterisk", "spc", "caps_lock",
      "num_lock", "scroll_lock", "print", "sysrq", "home", "pgup", "pgdn", "end", "left",
      "up", "down", "right", "insert", "delete", "meta_l", "meta_r", "pause"};
  for (const char* n : kNames) {
    if (k == n) return true;
  }
  if (k.size() == 1 && (std::isalnum(static_cast<unsigned char>(k[0])))) return true;
  if (k.size() >= 2 && k[0] == 'f') {
    int n = std::atoi(k.c_str() + 1);
    return n >= 1 && n <= 12 && k == "f" + std::to_string(n);
  }
  return false;
}

}  // namespace

Result<std::vector<json>> typeText(const std::string& text) {
  if (text.empty()) return invalidArg("text", "text must not be empty");
  if (text.size() > 4096) return invalidArg("text", "text longer than 4096 characters");
  std::vector<json> out;
  for (size_t i = 0; i < text.size(); ++i) {
    std::string qcode;
    bool shift = false;
    if (!charKey(text[i], &qcode, &shift)) {
      return invalidArg("text", "character " + std::to_string(i) +
                                    " cannot be typed (printable ASCII, newline and tab only)");
    }
    json ev = json::array();
    if (shift) ev.push_back(keyEvent("shift", true));
    ev.push_back(keyEvent(qcode, true));
    ev.push_back(keyEvent(qcode, false));
    if (shift) ev.push_back(keyEvent("shift", false));
    out.push_back(std::move(ev));
  }
  return out;
}

Result<json> keyCombo(const std::string& combo) {
  if (combo.empty() || combo.size() > 128) return invalidArg("key", "key must be 1-128 characters");
  std::vector<std::string> keys;
  std::string cur;
  auto flush = [&]() -> Status {
    std::string k = asciiLower(cur);
    if (auto a = aliases().find(k); a != aliases().end()) k = a->second;
    if (!knownQcode(k)) return invalidArg("key", "unknown key '" + cur + "' in '" + combo + "'");
    keys.push_back(k);
    cur.clear();
    return Status::ok();
  };
  for (size_t i = 0; i < combo.size(); ++i) {
    // "ctrl++" would be plus; a '+' that ends the combo or follows one is a key.
    if (combo[i] == '+' && !cur.empty()) {
      RETURN_IF_ERROR(flush());
    } else {
      cur += combo[i];
    }
  }
  if (cur == "+") cur = "equal";  // no plus key of its own on a US keyboard
  if (cur.empty()) return invalidArg("key", "empty key name in '" + combo + "'");
  RETURN_IF_ERROR(flush());
  json ev = json::array();
  for (auto& k : keys) ev.push_back(keyEvent(k, true));
  for (auto it = keys.rbegin(); it != keys.rend(); ++it) ev.push_back(keyEvent(*it, false));
  return ev;
}

Result<json> mouse(int x, int y, const std::string& button, int width, int height) {
  if (x < 0 || x >= width) {
    return invalidArg("x", "x must be within 0.." + std::to_string(width - 1));
  }
  if (y < 0 || y >= height) {
    return invalidArg("y", "y must be within 0.." + std::to_string(height - 1));
  }
  static const std::map<std::string, std::string> kButtons = {
      {"left", "left"}, {"right", "right"}, {"middle", "middle"},
      {"wheel-up", "wheel-up"}, {"wheel-down", "wheel-down"}};
  json ev = json::array();
  auto scale = [](int v, int size) { return size > 1 ? int64_t(v) * 32767 / (size - 1) : 0; };
  ev.push_back({{"type", "abs"}, {"data", {{"axis", "x"}, {"value", scale(x, width)}}}});
  ev.push_back({{"type", "abs"}, {"data", {{"axis", "y"}, {"value", scale(y, height)}}}});
  if (!button.empty()) {
    auto b = kButtons.find(button);
    if (b == kButtons.end()) {
      return invalidArg("button", "button must be left, right, middle, wheel-up or wheel-down");
    }
    ev.push_back({{"type", "btn"}, {"data", {{"down", true}, {"button", b->second}}}});
    ev.push_back({{"type", "btn"}, {"data", {{"down", false}, {"button", b->second}}}});
  }
  return ev;
}

}  // namespace dsec::edge::vminput
