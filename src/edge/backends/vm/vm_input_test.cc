// vminput: what text, key combinations and mouse actions become as QMP
// input-send-event lists; codeFromText: qga's error texts as status codes.
#include "edge/backends/vm/vm_input.h"

#include <gtest/gtest.h>

#include "edge/backends/vm/qga.h"

namespace dsec::edge {
namespace {

using nlohmann::json;

std::string qcodeOf(const json& ev) { return ev["data"]["key"]["data"].get<std::string>(); }

TEST(VmInput, TypeTextShiftsUpperCaseAndSymbols) {
  auto r = vminput::typeText("aB!\n");
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  ASSERT_EQ(r->size(), 4u);
  EXPECT_EQ((*r)[0].size(), 2u);
  EXPECT_EQ(qcodeOf((*r)[0][0]), "a");
  ASSERT_EQ((*r)[1].size(), 4u);
  EXPECT_EQ(qcodeOf((*r)[1][0]), "shift");
  EXPECT_EQ(qcodeOf((*r)[1][1]), "b");
  EXPECT_EQ(qcodeOf((*r)[2][1]), "1");
  EXPECT_EQ(qcodeOf((*r)[3][0]), "ret");
}

TEST(VmInput, TypeTextRefusesWhatAKeyboardCannotType) {
  auto r = vminput::typeText("caf\xc3\xa9");
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().field(), "text");
  EXPECT_FALSE(vminput::typeText("").isOk());
}

TEST(VmInput, KeyComboPressesInOrderAndReleasesInReverse) {
  auto r = vminput::keyCombo("Ctrl+Alt+Del");
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  ASSERT_EQ(r->size(), 6u);
  EXPECT_EQ(qcodeOf((*r)[0]), "ctrl");
  EXPECT_EQ(qcodeOf((*r)[2]), "delete");
  EXPECT_TRUE((*r)[2]["data"]["down"].get<bool>());
  EXPECT_EQ(qcodeOf((*r)[3]), "delete");
  EXPECT_FALSE((*r)[3]["data"]["down"].get<bool>());
  EXPECT_EQ(qcodeOf((*r)[5]), "ctrl");
  EXPECT_TRUE(vminput::keyCombo("Return").isOk());
  EXPECT_TRUE(vminput::keyCombo("F12").isOk());
  auto bad = vminput::keyCombo("ctrl+hyper");
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().field(), "key");
  EXPECT_FALSE(vminput::keyCombo("f13").isOk());
}

TEST(VmInput, MouseScalesToTheAbsoluteRangeAndChecksBounds) {
  auto r = vminput::mouse(639, 0, "left", 640, 480);
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  ASSERT_EQ(r->size(), 4u);
  EXPECT_EQ((*r)[0]["data"]["value"].get<int>(), 32767);
  EXPECT_EQ((*r)[1]["data"]["value"].get<int>(), 0);
  EXPECT_EQ((*r)[2]["data"]["button"].get<std::string>(), "left");
  EXPECT_EQ(vminput::mouse(10, 10, "", 640, 480)->size(), 2u);
  EXPECT_EQ(vminput::mouse(640, 0, "", 640, 480).status().field(), "x");
  EXPECT_EQ(vminput::mouse(0, -1, "", 640, 480).status().field(), "y");
  EXPECT_EQ(vminput::mouse(0, 0, "thumb", 640, 480).status().field(), "button");
}

TEST(QgaErrors, TextNamingAnErrnoGivesItsCode) {
  EXPECT_EQ(codeFromText("failed to open file '/x' (mode: 'r'): No such file or directory"),
            Code::kNotFound);
  EXPECT_EQ(codeFromText("mkdir: cannot create directory '/a': File exists"),
            Code::kAlreadyExists);
  EXPECT_EQ(codeFromText("Permission denied"), Code::kPermissionDenied);
  EXPECT_EQ(codeFromText("something else"), Code::kInternal);
}

}  // namespace
}  // namespace dsec::edge
