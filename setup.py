"""Build for sptr: one extension, sptr._C._kernels, holding every op.

CUDA sources are compiled when a CUDA toolkit and a CUDA build of torch are present, or when FORCE_CUDA=1;
otherwise a CPU-only extension is built (every op keeps its CPU kernel). Honours TORCH_CUDA_ARCH_LIST
(default 8.0;8.6;8.9;9.0a, with 9.0 instead of 9.0a where CUTLASS's headers are missing), MAX_JOBS and DEBUG=1.
With 9.0a (Hopper's wgmma and TMA) the MoE grouped GEMM is built on CUTLASS: its headers come from
$CUTLASS_PATH or the nvidia-cutlass wheel.
"""
import glob
import importlib.util
import os

from setuptools import find_packages, setup

# torch locates CUDA through `nvcc` on PATH; a wrapper there (e.g. /usr/local/bin/nvcc) makes it pick a
# CUDA_HOME without lib64/. Prefer the toolkit's canonical folder when it exists.
if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda/lib64"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("sptr", "_C")


def use_cuda() -> bool:
    if os.environ.get("FORCE_CUDA", "0") == "1":
        return True
    return CUDA_HOME is not None and torch.version.cuda is not None


def cuda_wheel_includes():
    """Header folders of the CUDA libraries that torch's pip wheels ship (cuSPARSE, cuBLAS, ...): ATen's CUDA
    headers include them, and a bare nvcc toolkit does not always carry them."""
    try:
        import nvidia
    except ImportError:
        return []
    roots = list(getattr(nvidia, "__path__", []))
    return sorted({d for r in roots for d in glob.glob(os.path.join(r, "*", "include")) if os.path.isdir(d)})


def cutlass_include():
    """CUTLASS's headers: $CUTLASS_PATH/include (a CUTLASS checkout), else those of the nvidia-cutlass wheel
    (cutlass_library/source/include, found without importing it); None when neither is there."""
    roots = []
    if os.environ.get("CUTLASS_PATH"):
        roots.append(os.path.join(os.environ["CUTLASS_PATH"], "include"))
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        roots += [os.path.join(p, "source", "include") for p in spec.submodule_search_locations]
    return next((r for r in roots if os.path.isfile(os.path.join(r, "cutlass", "cutlass.h"))), None)


def sm90a_requested() -> bool:
    """TORCH_CUDA_ARCH_LIST names 9.0a (Hopper's wgmma and TMA): the grouped GEMM's CUTLASS kernels are built."""
    arches = os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";")
    return any(a.split("+")[0] == "9.0a" for a in arches)


def extension():
    debug = os.environ.get("DEBUG", "0") == "1"
    cpp = sorted(glob.glob(os.path.join(CSRC, "**", "*.cpp"), recursive=True))
    cxx = ["-O0" if debug else "-O3"] + (["-g"] if debug else [])
    include = [os.path.join(ROOT, CSRC, "include")]
    if use_cuda():
        if "TORCH_CUDA_ARCH_LIST" not in os.environ:
            # Hopper as sm_90a (the CUTLASS grouped GEMM) where CUTLASS's headers are there, else plain sm_90.
            hopper = "9.0a" if cutlass_include() else "9.0"
            if hopper == "9.0":
                print("sptr: CUTLASS headers not found (pip install --no-deps nvidia-cutlass==4.2.0.0); building "
                      "sm_90 without the CUTLASS grouped GEMM")
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;8.6;8.9;" + hopper
        include += cuda_wheel_includes()
        cu = sorted(glob.glob(os.path.join(CSRC, "**", "*.cu"), recursive=True))
        nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"] + (["-g", "-G"] if debug else [])
        defines = ["-DSPTR_WITH_CUDA"]
        if sm90a_requested():
            cutlass = cutlass_include()
            if cutlass is None:
                raise RuntimeError("TORCH_CUDA_ARCH_LIST names 9.0a, whose grouped GEMM kernels need CUTLASS's "
                                   "headers: pip install --no-deps nvidia-cutlass==4.2.0.0, or set CUTLASS_PATH to "
                                   "a CUTLASS checkout (or leave 9.0a out of TORCH_CUDA_ARCH_LIST)")
            include.append(cutlass)
            defines.append("-DSPTR_WITH_SM90A")
        return CUDAExtension(
            "sptr._C._kernels", cpp + cu, include_dirs=include,
            extra_compile_args={"cxx": cxx + defines, "nvcc": nvcc + defines},
        )
    return CppExtension("sptr._C._kernels", cpp, include_dirs=include, extra_compile_args={"cxx": cxx})


setup(
    name="sptr",
    version="2.0.0",
    description="Fused-kernel layers for sparse 3D and multimodal transformers (SparseTransformer-compatible)",
    license="MIT",
    # configs/ is installed as sptr.configs, so that a non-editable install has the YAML files too
    packages=find_packages(include=["sptr", "sptr.*"]) + ["sptr.configs"],
    package_dir={"sptr.configs": "configs"},
    package_data={"sptr._C": ["**/*.h", "**/*.cuh", "**/*.cpp", "**/*.cu"],
                  "sptr.configs": ["*.yaml", "labels/*.yaml"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "einops", "safetensors", "pyyaml", "tqdm"],
    # The SphereFormer U-Net's sparse convolutions: spconv (CPU wheel) or spconv-cu12x on CUDA machines.
    extras_require={"test": ["pytest", "expecttest", "transformers==4.49.0"], "scatter": ["torch-scatter"],
                    "spconv": ["spconv>=2.3"], "spconv-cuda": ["spconv-cu126>=2.3"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
