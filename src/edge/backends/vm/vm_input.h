// Computer use on a vm sandbox (docs/vm.md): text, key combinations and
// mouse actions as QMP input-send-event batches (QEMU's QKeyCode names, an
// absolute pointer scaled to 0..32767). Pure functions, no QEMU involved.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"

namespace dsec::edge::vminput {

// One input-send-event "events" list per character of `text` (printable
// ASCII, \n as Return, \t as Tab): key down and up, with shift where the
// US layout needs it. Any other character is invalid_argument field "text".
Result<std::vector<nlohmann::json>> typeText(const std::string& text);

// A combination like "ctrl+alt+delete", "Return", "shift+a" or "F1": every
// key down in order, then up in reverse. Names are QKeyCode names
// ("ctrl", "alt", "ret", "esc", "a", "f1", ...) or common aliases ("enter",
// "return", "space", "escape", "control", "super", "pageup", ...), any case.
// Unknown names are invalid_argument field "key".
Result<nlohmann::json> keyCombo(const std::string& combo);

// Moves the absolute pointer to (x, y) of a width x height screen and, when
// `button` is not empty ("left", "right", "middle", "wheel-up",
// "wheel-down"), clicks it there. Out-of-screen coordinates are
// invalid_argument field "x" or "y"; an unknown button field "button".
Result<nlohmann::json> mouse(int x, int y, const std::string& button, int width, int height);

}  // namespace dsec::edge::vminput
