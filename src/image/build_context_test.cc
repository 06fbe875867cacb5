#include "image/build_context.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "common/sha256.h"
#include "common/util.h"
#include "image/layer_converter.h"

namespace dsec::image {
namespace {

class BuildContextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/build-ctx-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { (void)removeTree(dir_); }

  // A tar of entries made with tarOf from a set built here.
  std::string tarText(const std::vector<std::tuple<std::string, char, std::string>>& spec) {
    auto set = FileSet::create(dir_);
    EXPECT_TRUE(set.isOk());
    sets_.push_back(std::make_unique<FileSet>(std::move(*set)));
    FileSet& s = *sets_.back();
    std::vector<LayerEntry> entries;
    for (auto& [path, type, data] : spec) {
      LayerEntry e;
      e.path = "/" + path;
      e.mtime = 1700000000;
      if (type == 'd') {
        e.mode = S_IFDIR | 0755;
      } else if (type == 'l') {
        e.mode = S_IFLNK | 0777;
        e.link = data;
      } else {
        BuildFile f{path, S_IFREG | 0644};
        MemorySource in(data);
        f.size = data.size();
        EXPECT_TRUE(s.addFile(f, in).isOk());
        const BuildFile* got = s.find(path);
        e.mode = S_IFREG | 0644;
        e.size = got->size;
        e.fd = s.fd();
        e.offset = got->offset;
      }
      entries.push_back(e);
    }
    auto src = tarOf(std::move(entries));
    std::string out, buf(7000, '\0');  // odd reads
    for (;;) {
      auto n = src->read(buf.data(), buf.size());
      EXPECT_TRUE(n.isOk());
      if (!n.isOk() || *n == 0) break;
      out.append(buf.data(), *n);
    }
    return out;
  }

  FileSet context(const std::vector<std::tuple<std::string, char, std::string>>& spec) {
    MemorySource in(tarText(spec));
    auto set = readTarArchive(in, dir_, "context", true, true);
    EXPECT_TRUE(set.isOk()) << set.status().toString();
    return std::move(set).value();
  }

  static std::vector<std::string> rels(const CopySelection& s) {
    std::vector<std::string> out;
    for (auto& i : s.items) out.push_back(i.rel + (S_ISDIR(i.file->mode) ? "/" : ""));
    return out;
  }

  std::string dir_;
  std::vector<std::unique_ptr<FileSet>> sets_;
};

TEST_F(BuildContextTest, TarRoundTripsThroughTheArchiveReader) {
  std::string big(300000, 'x');
  std::string longName = std::string(120, 'n') + "/" + std::string(90, 'm');
  FileSet s = context({{"a", 'd', ""},
                       {"a/f.txt", 'f', "hello\n"},
                       {"a/big", 'f', big},
                       {"a/link", 'l', "f.txt"},
                       {longName, 'f', "long"},
                       {"empty", 'f', ""}});
  ASSERT_NE(s.find("a"), nullptr);
  EXPECT_TRUE(S_ISDIR(s.find("a")->mode));
  ASSERT_NE(s.find("a/f.txt"), nullptr);
  EXPECT_EQ(*s.read(*s.find("a/f.txt"), 100), "hello\n");
  EXPECT_EQ(s.find("a/f.txt")->sha256,
            "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03");
  EXPECT_EQ(*s.read(*s.find("a/big"), 1 << 20), big);
  EXPECT_EQ(s.find("a/link")->link, "f.txt");
  ASSERT_NE(s.find(longName), nullptr);
  EXPECT_EQ(*s.read(*s.find(longName), 100), "long");
  EXPECT_EQ(s.find("empty")->size, 0u);
}

TEST_F(BuildContextTest, TarOfConvertsToALayer) {
  std::string t = tarText({{"app", 'd', ""}, {"app/x", 'f', "x\n"}, {"app/l", 'l', "x"}});
  MemorySource in(t);
  auto c = convertTarLayer(in, LayerCompression::kNone, dir_ + "/layer");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  EXPECT_EQ(c->stats.entries, 3);
  EXPECT_EQ(c->stats.implicitDirs, 0);
}

TEST_F(BuildContextTest, NotAnArchiveIsToldApart) {
  MemorySource in("just some text, not a tar at all\n" + std::string(600, 'z'));
  bool notArchive = false;
  auto set = readTarArchive(in, dir_, "src", false, false, &notArchive);
  EXPECT_FALSE(set.isOk());
  EXPECT_TRUE(notArchive);
  MemorySource empty("");
  auto e = readTarArchive(empty, dir_, "context", true, true);
  ASSERT_TRUE(e.isOk()) << e.status().toString();
  EXPECT_TRUE(e->files().empty());
}

TEST_F(BuildContextTest, DockerIgnoreRemovesWhatItExcludes) {
  FileSet s = context({{".dockerignore", 'f', "*.log\nsecret/\n!secret/ok\n"},
                       {"a.log", 'f', "x"},
                       {"keep.txt", 'f', "k"},
                       {"secret", 'd', ""},
                       {"secret/key", 'f', "k"},
                       {"secret/ok", 'f', "k"}});
  ASSERT_TRUE(applyDockerIgnore(s).isOk());
  EXPECT_EQ(s.find("a.log"), nullptr);
  EXPECT_EQ(s.find("secret/key"), nullptr);
  EXPECT_NE(s.find("secret/ok"), nullptr);
  EXPECT_NE(s.find("keep.txt"), nullptr);
  FileSet bad = context({{".dockerignore", 'f', "!\n"}});
  Status st = applyDockerIgnore(bad);
  EXPECT_EQ(st.field(), "dockerignore");
}

TEST_F(BuildContextTest, CopySourcesFollowDockersRules) {
  FileSet s = context({{"src", 'd', ""},
                       {"src/a.py", 'f', "a"},
                       {"src/sub", 'd', ""},
                       {"src/sub/b.py", 'f', "b"},
                       {"top.txt", 'f', "t"},
                       {"two.txt", 'f', "2"},
                       {"lnk", 'l', "src/a.py"},
                       {"up", 'l', "../../top.txt"}});
  // A directory gives its contents.
  auto d = selectCopySources(s, {"src"}, {}, "COPY");
  ASSERT_TRUE(d.isOk());
  EXPECT_EQ(rels(*d), (std::vector<std::string>{"a.py", "sub/", "sub/b.py"}));
  EXPECT_FALSE(d->singleFile);
  // One file: itself, under its base name, maybe the destination itself.
  auto f = selectCopySources(s, {"/src/sub/b.py"}, {}, "COPY");
  ASSERT_TRUE(f.isOk());
  EXPECT_EQ(rels(*f), (std::vector<std::string>{"b.py"}));
  EXPECT_TRUE(f->singleFile);
  // Wildcards match at their depth; several matches make a directory.
  auto w = selectCopySources(s, {"*.txt"}, {}, "COPY");
  ASSERT_TRUE(w.isOk());
  EXPECT_EQ(rels(*w), (std::vector<std::string>{"top.txt", "two.txt"}));
  EXPECT_FALSE(w->singleFile);
  auto w1 = selectCopySources(s, {"to?.txt"}, {}, "COPY");
  ASSERT_TRUE(w1.isOk());
  EXPECT_TRUE(w1->singleFile);
  // A symlink named as a source is followed; its name is kept.
  auto l = selectCopySources(s, {"lnk"}, {}, "COPY");
  ASSERT_TRUE(l.isOk());
  ASSERT_EQ(l->items.size(), 1u);
  EXPECT_EQ(l->items[0].rel, "lnk");
  EXPECT_EQ(l->items[0].file->path, "src/a.py");
  // ".." in a link stops at the root.
  auto u = selectCopySources(s, {"up"}, {}, "COPY");
  ASSERT_TRUE(u.isOk());
  EXPECT_EQ(u->items[0].file->path, "top.txt");
  // "." is everything; --exclude patterns apply to the copied paths.
  auto all = selectCopySources(s, {"."}, {"*.txt", "src/sub"}, "COPY");
  ASSERT_TRUE(all.isOk());
  EXPECT_EQ(rels(*all), (std::vector<std::string>{"lnk", "src/", "src/a.py", "up"}));
  // Errors name what is missing.
  auto missing = selectCopySources(s, {"nope"}, {}, "COPY");
  ASSERT_FALSE(missing.isOk());
  EXPECT_EQ(missing.status().field(), "dockerfile");
  EXPECT_NE(missing.status().message().find("\"nope\" not found"), std::string::npos);
  auto none = selectCopySources(s, {"*.md"}, {}, "ADD");
  ASSERT_FALSE(none.isOk());
  EXPECT_NE(none.status().message().find("ADD failed: no source files match"), std::string::npos);
  EXPECT_FALSE(selectCopySources(s, {"../x"}, {}, "COPY").isOk());
}

TEST_F(BuildContextTest, DestinationsResolveAgainstTheWorkdir) {
  bool dir = false;
  EXPECT_EQ(resolveDest("app/", "/srv", &dir), "/srv/app");
  EXPECT_TRUE(dir);
  EXPECT_EQ(resolveDest("/x/y", "/srv", &dir), "/x/y");
  EXPECT_FALSE(dir);
  EXPECT_EQ(resolveDest(".", "", &dir), "/");
  EXPECT_TRUE(dir);
  EXPECT_EQ(resolveDest("../../..", "/a", &dir), "/");
}

TEST_F(BuildContextTest, TheCacheKeyMovesWithWhatTheStepReads) {
  FileSet a = context({{"x", 'f', "one"}, {"y", 'f', "two"}});
  FileSet b = context({{"x", 'f', "one"}, {"y", 'f', "TWO"}});
  auto sa = selectCopySources(a, {"x"}, {}, "COPY");
  auto sb = selectCopySources(b, {"x"}, {}, "COPY");
  auto ya = selectCopySources(a, {"y"}, {}, "COPY");
  auto yb = selectCopySources(b, {"y"}, {}, "COPY");
  ASSERT_TRUE(sa.isOk() && sb.isOk() && ya.isOk() && yb.isOk());
  StepKeyInput in;
  in.parent = "sha256:parent";
  in.owner = "admin";
  in.instruction = "COPY x /x";
  in.files = sa->items;
  std::string k1 = stepCacheKey(in);
  in.files = sb->items;
  EXPECT_EQ(stepCacheKey(in), k1);  // y changed, x did not
  in.files = ya->items;
  std::string ky = stepCacheKey(in);
  in.files = yb->items;
  EXPECT_NE(stepCacheKey(in), ky);
  in.files = sa->items;
  for (auto change : std::vector<std::function<void(StepKeyInput&)>>{
           [](StepKeyInput& i) { i.parent = "sha256:other"; },
           [](StepKeyInput& i) { i.owner = "t1"; },
           [](StepKeyInput& i) { i.instruction = "COPY x /y"; },
           [](StepKeyInput& i) { i.env = {"A=1"}; }, [](StepKeyInput& i) { i.user = "nobody"; },
           [](StepKeyInput& i) { i.workdir = "/w"; }, [](StepKeyInput& i) { i.network = true; },
           [](StepKeyInput& i) {
             i.shell = {"/bin/bash", "-c"};
           }}) {
    StepKeyInput c = in;
    change(c);
    EXPECT_NE(stepCacheKey(c), k1);
  }
  EXPECT_EQ(k1.substr(0, 7), "sha256:");
  EXPECT_EQ(k1.size(), 71u);
}

TEST_F(BuildContextTest, ChownTakesIdsOrNamesFromTheImage) {
  std::string passwd = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001::/home/app:/bin/sh\n";
  std::string group = "root:x:0:\nstaff:x:50:\n";
  auto o = resolveChown("10:20", std::nullopt, std::nullopt);
  ASSERT_TRUE(o.isOk());
  EXPECT_EQ(o->uid, 10u);
  EXPECT_EQ(o->gid, 20u);
  o = resolveChown("7", std::nullopt, std::nullopt);  // no group: the uid's number
  ASSERT_TRUE(o.isOk());
  EXPECT_EQ(o->gid, 7u);
  o = resolveChown("app", passwd, group);
  ASSERT_TRUE(o.isOk());
  EXPECT_EQ(o->uid, 1000u);
  EXPECT_EQ(o->gid, 1000u);
  o = resolveChown("app:staff", passwd, group);
  ASSERT_TRUE(o.isOk());
  EXPECT_EQ(o->gid, 50u);
  EXPECT_FALSE(chownNeedsNames("1:2"));
  EXPECT_TRUE(chownNeedsNames("app"));
  EXPECT_TRUE(chownNeedsNames("1:staff"));
  auto bad = resolveChown("nobody", passwd, group);
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().field(), "dockerfile");
  EXPECT_FALSE(resolveChown("app", std::nullopt, std::nullopt).isOk());
  EXPECT_FALSE(resolveChown("1:", std::nullopt, std::nullopt).isOk());
  EXPECT_FALSE(resolveChown("4294967295", std::nullopt, std::nullopt).isOk());
}

TEST_F(BuildContextTest, ArchivesAreToldByTheirFirstBytes) {
  EXPECT_TRUE(looksLikeArchive(std::string("\x1f\x8b\x08\0", 4)));
  EXPECT_TRUE(looksLikeArchive("BZh91AY"));
  EXPECT_TRUE(
      looksLikeArchive(std::string("\xfd"
                                   "7zXZ\0\0",
                                   7)));
  EXPECT_TRUE(looksLikeArchive(std::string("\x28\xb5\x2f\xfd\0", 5)));
  std::string tar = tarText({{"x", 'f', "y"}});
  EXPECT_TRUE(looksLikeArchive(tar.substr(0, 512)));
  EXPECT_FALSE(looksLikeArchive("#!/bin/sh\necho hi\n"));
  EXPECT_FALSE(looksLikeArchive(""));
}

TEST_F(BuildContextTest, InstructionTextIsCanonical) {
  Instruction i;
  i.keyword = "COPY";
  i.args = {"a", "b"};
  i.flags = {{"chown", "1:2"}, {"chmod", "644"}};
  Instruction j = i;
  j.flags = {{"chmod", "644"}, {"chown", "1:2"}};
  EXPECT_EQ(instructionText(i), instructionText(j));
  j.flags["chown"] = "1:3";
  EXPECT_NE(instructionText(i), instructionText(j));
}

TEST_F(BuildContextTest, PackContextDirHonoursDockerIgnore) {
  std::string ctx = dir_ + "/ctx";
  ASSERT_TRUE(makeDirs(ctx + "/sub/deep").isOk());
  ASSERT_TRUE(makeDirs(ctx + "/node_modules/x").isOk());
  ASSERT_TRUE(writeFileAtomic(ctx + "/.dockerignore", "node_modules\n*.tmp\n").isOk());
  ASSERT_TRUE(writeFileAtomic(ctx + "/Dockerfile", "FROM scratch\n").isOk());
  ASSERT_TRUE(writeFileAtomic(ctx + "/a.tmp", "t").isOk());
  ASSERT_TRUE(writeFileAtomic(ctx + "/sub/deep/f", "deep").isOk());
  ASSERT_TRUE(writeFileAtomic(ctx + "/node_modules/x/y", "y").isOk());
  ASSERT_EQ(::symlink("sub/deep/f", (ctx + "/ln").c_str()), 0);
  std::string out = dir_ + "/ctx.tar";
  UniqueFd fd(::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  auto packed = packContextDir(ctx, fd.get());
  ASSERT_TRUE(packed.isOk()) << packed.status().toString();
  fd.reset();
  auto bytes = readFile(out);
  ASSERT_TRUE(bytes.isOk());
  EXPECT_EQ(packed->size, bytes->size());
  EXPECT_EQ(packed->digest, "sha256:" + sha256Hex(*bytes));
  MemorySource in(*bytes);
  auto set = readTarArchive(in, dir_, "context", true, true);
  ASSERT_TRUE(set.isOk()) << set.status().toString();
  std::vector<std::string> paths;
  for (auto& [p, f] : set->files()) paths.push_back(p);
  EXPECT_EQ(paths, (std::vector<std::string>{".dockerignore", "Dockerfile", "ln", "sub", "sub/deep",
                                             "sub/deep/f"}));
  // The same directory packs to the same bytes.
  std::string out2 = dir_ + "/ctx2.tar";
  UniqueFd fd2(::open(out2.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  auto again = packContextDir(ctx, fd2.get());
  ASSERT_TRUE(again.isOk());
  EXPECT_EQ(again->digest, packed->digest);
}

}  // namespace
}  // namespace dsec::image
