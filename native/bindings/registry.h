// Each binding file registers its ops with PYENGINE_REGISTER_OPS(fn), where
// fn(pybind11::module_&) defines the Python functions. The module file
// (cpu_module.cpp / cuda_module.cpp) runs every registered fn at import.
// This keeps one pybind11 module per device while each kernel family owns
// its own binding file.
//
// Binding convention (docs/architecture.md, "Native kernels"): functions take raw device pointers as
// uintptr_t plus sizes, never torch types, and release the GIL:
//   m.def("rms_norm", &rms_norm_binding, py::call_guard<py::gil_scoped_release>());
#pragma once
#include <pybind11/pybind11.h>

#include <vector>

namespace pyengine {
using OpsRegistrar = void (*)(pybind11::module_&);

std::vector<OpsRegistrar>& ops_registrars();

struct RegisterOps {
  explicit RegisterOps(OpsRegistrar fn) { ops_registrars().push_back(fn); }
};
}  // namespace pyengine

#define PYENGINE_REGISTER_OPS(fn) static ::pyengine::RegisterOps pyengine_register_ops_##fn(fn)
