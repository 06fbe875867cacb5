// Reading tar with libarchive from our ByteSources, as tar_stream.cc and
// build_context.cc both do.
#pragma once

#include <archive.h>
#include <errno.h>
#include <locale.h>

#include <vector>

#include "common/status.h"
#include "image/tar_stream.h"

namespace dsec::image {

// Runs the calling thread in the "C" locale while it lives. libarchive then
// converts no names: a PAX name it cannot convert to ASCII is kept as the raw
// bytes stored, where a UTF-8 locale would NFC-normalise it.
class CLocaleScope {
 public:
  CLocaleScope() : loc_(newlocale(LC_ALL_MASK, "C", locale_t(0))) {
    if (loc_) old_ = uselocale(loc_);
  }
  ~CLocaleScope() {
    if (loc_) {
      uselocale(old_);
      freelocale(loc_);
    }
  }
  CLocaleScope(const CLocaleScope&) = delete;
  CLocaleScope& operator=(const CLocaleScope&) = delete;

 private:
  locale_t loc_;
  locale_t old_ = LC_GLOBAL_LOCALE;
};

// archive_read_open's client data: the source and a buffer for it.
struct ArchiveInput {
  ByteSource* src = nullptr;
  std::vector<char> buf;
  Status err;  // what the source failed with, kept over libarchive's copy
};

// archive_read_open's read callback over an ArchiveInput.
inline la_ssize_t archiveRead(struct archive* a, void* ud, const void** out) {
  auto* in = static_cast<ArchiveInput*>(ud);
  auto got = in->src->read(in->buf.data(), in->buf.size());
  if (!got.isOk()) {
    in->err = std::move(got).takeStatus();
    archive_set_error(a, EIO, "%s", in->err.message().c_str());
    return -1;
  }
  *out = in->buf.data();
  return la_ssize_t(*got);
}

}  // namespace dsec::image
