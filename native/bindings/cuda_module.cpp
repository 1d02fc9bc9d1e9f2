// pyengine._cuda: the CUDA kernels. Ops register themselves (registry.h),
// with the same names and argument lists as pyengine._C.
#include <cuda_runtime.h>

#include "registry.h"

namespace py = pybind11;

namespace pyengine {
std::vector<OpsRegistrar>& ops_registrars() {
  static std::vector<OpsRegistrar> fns;
  return fns;
}
}  // namespace pyengine

namespace {
// 0 when there is no driver, no GPU or any other CUDA error: importing the
// module must work on machines without a GPU.
int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
}
}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "pyengine CUDA kernels";
  m.def("device_count", &device_count, "Number of CUDA devices visible to this process (0 without a GPU/driver).");
  m.def("is_available", [] { return device_count() > 0; }, "Whether a CUDA device can run these kernels.");
  m.def("runtime_version", [] {
    int v = 0;
    cudaRuntimeGetVersion(&v);
    return v;
  }, "CUDA runtime version this module was built with (e.g. 13000).");
  for (auto fn : pyengine::ops_registrars()) fn(m);
}
