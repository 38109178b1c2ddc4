// Reading model metadata safely: integers range-checked before narrowing, floats finite and in
// range, names from the file made printable (model_config.cpp).
#pragma once
#include <cstdint>
#include <string>

#include "gguf/gguf_reader.h"

namespace tf {

int64_t int_in(const GgufFile& f, const std::string& key, int64_t v, int64_t lo, int64_t hi);
int int_key(const GgufFile& f, const std::string& key, int64_t lo, int64_t hi);
int int_key(const GgufFile& f, const std::string& key, int64_t def, int64_t lo, int64_t hi);
float float_key(const GgufFile& f, const std::string& key, double def, double lo, double hi);
std::string printable(const std::string& s);

}  // namespace tf
