// pyengine._C: the CPU kernels. Ops register themselves (registry.h).
#include "pyengine/parallel.h"
#include "registry.h"

namespace py = pybind11;

namespace pyengine {
std::vector<OpsRegistrar>& ops_registrars() {
  static std::vector<OpsRegistrar> fns;
  return fns;
}
}  // namespace pyengine

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyengine CPU kernels";
  m.def("num_threads", [] { return pyengine::ThreadPool::instance().num_threads(); },
        "Threads the native CPU kernels use (an OpenMP team shared with torch).");
  m.def("set_num_threads", [](int n) { pyengine::ThreadPool::instance().set_num_threads(n); },
        py::arg("n"), "Set the threads the native CPU kernels use (n >= 1).");
  m.def("isa", [] {
#if defined(__AVX512BF16__)
    return "avx512_bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
  }, "The SIMD path this build was compiled for (set with PYENGINE_CPU_ARCH at build time); "
     "avx512_bf16: with the bf16 dot products the bf16 kernels (attention, linear) are built on.");
  for (auto fn : pyengine::ops_registrars()) fn(m);
}
