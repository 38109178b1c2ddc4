#include "bindings/bindings.h"
namespace tf {
void bind_engine(pybind11::module_&) {}
}  // namespace tf
