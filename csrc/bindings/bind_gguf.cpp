#include "bindings/bindings.h"
namespace tf {
void bind_gguf(pybind11::module_&) {}
}  // namespace tf
