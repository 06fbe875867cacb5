// Runs the calling thread in the "C" locale while it lives. libarchive then
// converts no names: a PAX name it cannot convert to ASCII is kept as the raw
// bytes stored, where a UTF-8 locale would NFC-normalise it (tar_stream.cc,
// build_context.cc).
#pragma once

#include <locale.h>

namespace dsec::image {

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

}  // namespace dsec::image
