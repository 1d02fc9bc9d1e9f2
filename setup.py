"""Build the native core.

Extensions:
  pyengine._C      C++17 CPU kernels (native/cpu, a folder per operation) bound with pybind11 (native/bindings/cpu_*.cpp).
  pyengine.*.*     Cython modules (every pyengine/**/*.pyx: the engine's block pool and scheduler, the
                   model runner's batch preparation).
  pyengine._cuda   CUDA kernels (native/cuda/*.cu) + bindings (native/bindings/cuda_*.cpp),
                   built when nvcc is found; links the CUDA runtime, never torch.

Environment switches:
  PYENGINE_CPU_ARCH   value for -march (default "native": the build host's ISA, so AVX-512 where
                      the host has it; "x86-64-v3" gives the AVX2 path, "x86-64" the scalar one).
  PYENGINE_SKIP_CUDA  set to 1 to skip the CUDA extension even when nvcc exists.
  PYENGINE_CUDA_ARCHS space-separated SM list (default "80 90").
  MAX_JOBS            parallel compile jobs (default: CPU count).
"""
import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
ParallelCompile("MAX_JOBS", default=os.cpu_count() or 1).install()


def rel(pattern: str) -> list[str]:
    """Paths matching `pattern` (`**` spans folders), relative to the checkout, sorted."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


CPU_ARCH = os.environ.get("PYENGINE_CPU_ARCH", "native")
# -fopenmp links libgomp.so.1, the soname torch ships: torch loads first, so both share one runtime
# (parallel.h asks it whether a kernel is called from inside one of torch's parallel regions and
# reads its default thread count).
CXX_FLAGS = ["-O3", f"-march={CPU_ARCH}", "-fno-math-errno", "-fopenmp", "-Wall", "-Wno-unused-function"]

ext_modules = [
    Pybind11Extension(
        "pyengine._C",
        rel("native/bindings/cpu_*.cpp") + rel("native/cpu/**/*.cpp"),
        include_dirs=["native/include"],
        depends=rel("native/include/pyengine/*.h") + rel("native/cpu/**/*.h") + rel("native/bindings/*.h"),
        extra_compile_args=CXX_FLAGS,
        extra_link_args=["-fopenmp"],
        cxx_std=17,
    )
]

pyx_files = rel("pyengine/**/*.pyx")
if pyx_files:
    from Cython.Build import cythonize

    cython_exts = [
        Extension(
            os.path.splitext(p)[0].replace(os.sep, "."),
            [p],
            extra_compile_args=["-O3"],
        )
        for p in pyx_files
    ]
    ext_modules += cythonize(
        cython_exts,
        compiler_directives={"language_level": 3, "boundscheck": False, "wraparound": False},
    )


def find_nvcc() -> str | None:
    if os.environ.get("PYENGINE_SKIP_CUDA", "0") not in ("", "0"):
        return None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc")


def cuda_home_of(nvcc: str) -> str:
    """The CUDA toolkit root; nvcc on PATH may be a wrapper script, so look for libcudart."""
    for cand in [os.environ.get("CUDA_HOME"), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]:
        if cand and os.path.exists(os.path.join(cand, "lib64", "libcudart.so")):
            return cand
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


NVCC = find_nvcc()
if NVCC and rel("native/cuda/*.cu"):
    CUDA_HOME = cuda_home_of(NVCC)
    ext_modules.append(
        Pybind11Extension(
            "pyengine._cuda",
            rel("native/bindings/cuda_*.cpp"),
            include_dirs=["native/include", os.path.join(CUDA_HOME, "include")],
            depends=rel("native/include/pyengine/*.h") + rel("native/bindings/*.h"),
            library_dirs=[os.path.join(CUDA_HOME, "lib64")],
            runtime_library_dirs=[os.path.join(CUDA_HOME, "lib64")],
            libraries=["cudart"],
            extra_compile_args=["-O3", "-pthread"],
            cxx_std=17,
        )
    )


class BuildExt(build_ext):
    """Compiles the .cu files of pyengine._cuda with nvcc; a CUDA compile error fails the build."""

    def build_extension(self, ext):
        if ext.name == "pyengine._cuda":
            ext.extra_objects = self._compile_cuda()
        super().build_extension(ext)

    def _compile_cuda(self) -> list[str]:
        archs = os.environ.get("PYENGINE_CUDA_ARCHS", "80 90").split()
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        out_dir = os.path.join(self.build_temp, "cuda")
        os.makedirs(out_dir, exist_ok=True)
        headers = rel("native/include/pyengine/*.h") + rel("native/cuda/*.cuh")
        commands, objects = [], []
        for src in rel("native/cuda/*.cu"):
            obj = os.path.join(out_dir, os.path.basename(src) + ".o")
            newest_input = max(os.path.getmtime(p) for p in [src, *headers])
            if self.force or not os.path.exists(obj) or os.path.getmtime(obj) < newest_input:
                commands.append([NVCC, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Inative/include",
                                 "--compiler-options", "-fPIC", "--expt-relaxed-constexpr", *gencode])
            objects.append(obj)
        jobs = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
            for cmd in commands:
                print(" ".join(cmd), file=sys.stderr)
            list(pool.map(lambda cmd: subprocess.run(cmd, check=True, cwd=ROOT), commands))
        return objects


setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
