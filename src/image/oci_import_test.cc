#include "image/oci_import.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <tuple>
#include <utility>

#include "common/sha256.h"
#include "common/util.h"

namespace dsec::image {
namespace {

TEST(OciImportTest, TranslatesWhiteoutsAndOpaqueDirs) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root for mknod and trusted.* xattrs";
  std::string dir = "/tmp/dsec-wh-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir + "/a/opq").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/a/.wh.gone", "").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/a/.wh.kept", "").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/a/kept", "same layer\n").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/a/opq/.wh..wh..opq", "").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/a/opq/new", "n").isOk());
  ASSERT_TRUE(translateWhiteouts(dir).isOk());
  struct stat st;
  ASSERT_EQ(lstat((dir + "/a/gone").c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(major(st.st_rdev), 0u);
  EXPECT_EQ(minor(st.st_rdev), 0u);
  EXPECT_NE(lstat((dir + "/a/.wh.gone").c_str(), &st), 0);
  ASSERT_EQ(lstat((dir + "/a/kept").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "a whiteout hides only lower layers' files";
  char v[8] = {};
  ASSERT_EQ(lgetxattr((dir + "/a/opq").c_str(), "trusted.overlay.opaque", v, sizeof v), 1);
  EXPECT_EQ(v[0], 'y');
  EXPECT_NE(lstat((dir + "/a/opq/.wh..wh..opq").c_str(), &st), 0);
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(OciImportTest, DetectsFormatsOfDirectories) {
  std::string dir = "/tmp/dsec-fmt-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir + "/oci").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/oci/oci-layout", "{}").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/oci/index.json", "{}").isOk());
  ASSERT_TRUE(makeDirs(dir + "/docker").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/docker/manifest.json", "[]").isOk());
  ASSERT_TRUE(makeDirs(dir + "/rootfs/etc").isOk());
  EXPECT_EQ(*detectFormat(dir + "/oci"), ArchiveFormat::kOciLayout);
  EXPECT_EQ(*detectFormat(dir + "/docker"), ArchiveFormat::kDockerSave);
  EXPECT_EQ(*detectFormat(dir + "/rootfs"), ArchiveFormat::kRootfs);
  EXPECT_EQ(detectFormat(dir + "/nope").status().code(), Code::kNotFound);
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(OciImportTest, ParsesTheConfigFields) {
  auto c = parseImageConfig(
      R"({"architecture":"amd64","config":{"User":"1000:1000","Env":["FOO=bar","PATH=/bin"],)"
      R"("WorkingDir":"/work/./sub//x/../","Cmd":["sh"]}})",
      "cfg");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  EXPECT_EQ(c->user, "1000:1000");
  EXPECT_EQ(c->env, (std::vector<std::string>{"FOO=bar", "PATH=/bin"}));
  EXPECT_EQ(c->workingDir, "/work/sub") << "normalised as Docker's WORKDIR is";
  // Fields, or the whole "config", may be absent or null: an empty config.
  for (const char* text : {R"({})", R"({"config":null})", R"({"config":{}})",
                           R"({"config":{"User":null,"Env":null,"WorkingDir":""}})"}) {
    auto e = parseImageConfig(text, "cfg");
    ASSERT_TRUE(e.isOk()) << text << ": " << e.status().toString();
    EXPECT_TRUE(e->empty()) << text;
  }
  EXPECT_EQ(parseImageConfig(R"({"config":{"WorkingDir":"/.."}})", "cfg")->workingDir, "/");
  for (const char* bad : {"not json", R"([])", R"({"config":"x"})", R"({"config":{"User":0}})",
                          R"({"config":{"Env":"A=B"}})", R"({"config":{"Env":[1]}})",
                          R"({"config":{"WorkingDir":"rel/dir"}})"}) {
    auto e = parseImageConfig(bad, "cfg");
    EXPECT_EQ(e.status().code(), Code::kInvalidArgument) << bad;
    EXPECT_EQ(e.status().field(), "path") << bad;
    EXPECT_NE(e.status().message().find("cfg"), std::string::npos) << e.status().message();
  }
}

// Writes `data` as a blob of the OCI layout at `root`; returns its digest.
std::string putBlob(const std::string& root, const std::string& data) {
  std::string hex = sha256Hex(data);
  EXPECT_TRUE(writeFileAtomic(root + "/blobs/sha256/" + hex, data).isOk());
  return "sha256:" + hex;
}

// Builds an OCI layout and a `docker save` tree holding one layer `layerTar`
// and the config `config`; `withConfig` false leaves the config file out.
void buildArchives(const std::string& dir, const std::string& layerTar, const std::string& config,
                   bool withConfig) {
  std::string oci = dir + "/oci";
  ASSERT_TRUE(makeDirs(oci + "/blobs/sha256").isOk());
  ASSERT_TRUE(writeFileAtomic(oci + "/oci-layout", R"({"imageLayoutVersion":"1.0.0"})").isOk());
  std::string layer = putBlob(oci, layerTar);
  std::string cfg = "sha256:" + sha256Hex(config);
  if (withConfig) {
    ASSERT_EQ(putBlob(oci, config), cfg);
  }
  std::string manifest = R"({"schemaVersion":2,"config":{"digest":")" + cfg + R"(","size":)" +
                         std::to_string(config.size()) + R"(},"layers":[{"digest":")" + layer +
                         R"(","size":)" + std::to_string(layerTar.size()) + "}]}";
  std::string m = putBlob(oci, manifest);
  ASSERT_TRUE(writeFileAtomic(oci + "/index.json",
                              R"({"schemaVersion":2,"manifests":[{"digest":")" + m + R"("}]})")
                  .isOk());

  std::string docker = dir + "/docker";
  ASSERT_TRUE(makeDirs(docker + "/l0").isOk());
  ASSERT_TRUE(writeFileAtomic(docker + "/l0/layer.tar", layerTar).isOk());
  if (withConfig) {
    ASSERT_TRUE(writeFileAtomic(docker + "/cfg.json", config).isOk());
  }
  ASSERT_TRUE(
      writeFileAtomic(docker + "/manifest.json",
                      R"([{"Config":"cfg.json","RepoTags":["x:1"],"Layers":["l0/layer.tar"]}])")
          .isOk());
}

TEST(OciImportTest, ImportsTheConfigOfOciLayoutsAndDockerSaves) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to extract layers with their owners";
  if (access("/usr/bin/mkfs.erofs", X_OK) != 0) GTEST_SKIP() << "mkfs.erofs not installed";
  std::string dir = "/tmp/dsec-cfg-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir + "/src/work").isOk());
  ASSERT_TRUE(makeDirs(dir + "/src/etc").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/src/etc/passwd", "app:x:1000:1000::/work:/bin/sh\n").isOk());
  ASSERT_TRUE(runCommand({"tar", "-C", dir + "/src", "-cf", dir + "/layer.tar", "."}).isOk());
  auto layerTar = readFile(dir + "/layer.tar");
  ASSERT_TRUE(layerTar.isOk());
  std::string config =
      R"({"architecture":"amd64","os":"linux","config":{"User":"app","Env":["FOO=bar"],)"
      R"("WorkingDir":"/work"},"rootfs":{"type":"layers","diff_ids":[]}})";
  buildArchives(dir, *layerTar, config, true);
  for (auto [sub, format] : {std::pair{"oci", ArchiveFormat::kOciLayout},
                             std::pair{"docker", ArchiveFormat::kDockerSave}}) {
    ASSERT_EQ(*detectFormat(dir + "/" + sub), format);
    auto img = importImage(dir + "/" + sub, format, dir + "/work-" + sub);
    ASSERT_TRUE(img.isOk()) << sub << ": " << img.status().toString();
    EXPECT_EQ(img->layers.size(), 1u);
    EXPECT_EQ(img->config.user, "app") << sub;
    EXPECT_EQ(img->config.env, std::vector<std::string>{"FOO=bar"}) << sub;
    EXPECT_EQ(img->config.workingDir, "/work") << sub;
  }
  // A root filesystem has no config.
  auto rootfs = importImage(dir + "/src", ArchiveFormat::kRootfs, dir + "/work-rootfs");
  ASSERT_TRUE(rootfs.isOk()) << rootfs.status().toString();
  EXPECT_TRUE(rootfs->config.empty());
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(OciImportTest, OwnersOutsideTheWidthAreSummedOverLayers) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to chown layer files to ids up to 1000000";
  if (access("/usr/bin/mkfs.erofs", X_OK) != 0) GTEST_SKIP() << "mkfs.erofs not installed";
  std::string dir = "/tmp/dsec-owners-import-" + randomHex(4);
  auto owned = [&](const std::string& path, uid_t uid, gid_t gid) {
    ASSERT_TRUE(writeFileAtomic(path, "x\n").isOk()) << path;
    ASSERT_EQ(::chown(path.c_str(), uid, gid), 0) << path;
  };
  // Layer 0: opt/win.txt (197609) and an ordinary file; layer 1 replaces
  // opt/win.txt and adds big (1000000).
  ASSERT_TRUE(makeDirs(dir + "/l0/opt").isOk());
  ASSERT_TRUE(makeDirs(dir + "/l1/opt").isOk());
  owned(dir + "/l0/opt/win.txt", 197609, 197609);
  owned(dir + "/l0/ok.txt", 65535, 0);
  owned(dir + "/l1/opt/win.txt", 197609, 197609);
  owned(dir + "/l1/big", 1000000, 1000000);
  std::string docker = dir + "/docker";
  for (const char* l : {"l0", "l1"}) {
    ASSERT_TRUE(makeDirs(docker + "/" + l).isOk());
    ASSERT_TRUE(runCommand({"tar", "--numeric-owner", "-C", dir + "/" + l, "-cf",
                            docker + "/" + l + "/layer.tar", "."})
                    .isOk());
  }
  ASSERT_TRUE(writeFileAtomic(docker + "/cfg.json", R"({"config":{}})").isOk());
  ASSERT_TRUE(writeFileAtomic(docker + "/manifest.json",
                              R"([{"Config":"cfg.json","Layers":["l0/layer.tar","l1/layer.tar"]}])")
                  .isOk());

  auto img = importImage(docker, ArchiveFormat::kDockerSave, dir + "/work-a");
  ASSERT_TRUE(img.isOk()) << img.status().toString();
  ASSERT_EQ(img->layers.size(), 2u);
  EXPECT_EQ(img->layers[0].owners.outside, 1);
  EXPECT_EQ(img->layers[1].owners.outside, 2);
  const OwnerReport& o = img->owners;
  EXPECT_EQ(o.width, kDefaultOwnerWidth);
  EXPECT_EQ(o.outside, 3);
  EXPECT_EQ(o.maxUid, 1000000u);
  EXPECT_EQ(o.maxGid, 1000000u);
  std::vector<OwnerExample> want = {{"opt/win.txt", 197609, 197609}, {"big", 1000000, 1000000}};
  EXPECT_EQ(o.examples, want);

  // A node mapping 2^20 ids keeps them all; width 0 skips the scan.
  auto wide = importImage(docker, ArchiveFormat::kDockerSave, dir + "/work-b", 1 << 20);
  ASSERT_TRUE(wide.isOk()) << wide.status().toString();
  EXPECT_EQ(wide->owners.outside, 0);
  EXPECT_EQ(wide->owners.maxUid, 1000000u);
  auto off = importImage(docker, ArchiveFormat::kDockerSave, dir + "/work-c", 0);
  ASSERT_TRUE(off.isOk()) << off.status().toString();
  EXPECT_EQ(off->owners.width, 0u);
  EXPECT_EQ(off->owners.entries, 0);

  // A root filesystem import reports too.
  auto rootfs = importImage(dir + "/l1", ArchiveFormat::kRootfs, dir + "/work-d");
  ASSERT_TRUE(rootfs.isOk()) << rootfs.status().toString();
  EXPECT_EQ(rootfs->owners.outside, 2);
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(OciImportTest, AMissingConfigIsRefusedBeforeAnyLayerIsBuilt) {
  std::string dir = "/tmp/dsec-nocfg-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir).isOk());
  buildArchives(dir, "not even a tar", R"({"config":{}})", false);
  for (auto [sub, format, want] :
       {std::tuple{"oci", ArchiveFormat::kOciLayout, "config blob"},
        std::tuple{"docker", ArchiveFormat::kDockerSave, "config cfg.json missing"}}) {
    auto img = importImage(dir + "/" + sub, format, dir + "/work-" + sub);
    EXPECT_EQ(img.status().code(), Code::kInvalidArgument) << sub;
    EXPECT_EQ(img.status().field(), "path") << sub;
    EXPECT_NE(img.status().message().find(want), std::string::npos) << img.status().message();
  }
  // A manifest that names no config at all, and one whose Config leaves the archive.
  ASSERT_TRUE(
      writeFileAtomic(dir + "/docker/manifest.json", R"([{"Layers":["l0/layer.tar"]}])").isOk());
  auto none = importImage(dir + "/docker", ArchiveFormat::kDockerSave, dir + "/work-none");
  EXPECT_NE(none.status().message().find("names no Config"), std::string::npos)
      << none.status().toString();
  ASSERT_TRUE(writeFileAtomic(dir + "/docker/manifest.json",
                              R"([{"Config":"../../etc/passwd","Layers":["l0/layer.tar"]}])")
                  .isOk());
  auto escape = importImage(dir + "/docker", ArchiveFormat::kDockerSave, dir + "/work-esc");
  EXPECT_NE(escape.status().message().find("leaves the archive"), std::string::npos)
      << escape.status().toString();
  ASSERT_TRUE(removeTree(dir).isOk());
}

}  // namespace
}  // namespace dsec::image
