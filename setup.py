"""Builds the Cython hot loops in ext/; everything else is declared in pyproject.toml."""
import importlib.util
import os
from glob import glob

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

COMMON = dict(extra_compile_args=["-O3"], define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])


def tvm_ffi_paths() -> tuple[str, str] | None:
    """tvm-ffi's C headers and library (installed with xgrammar), for ext/grammar_step.pyx; None when
    absent (that module is then not built, and ext.load gives its twin)."""
    spec = importlib.util.find_spec("tvm_ffi")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = spec.submodule_search_locations[0]
    include, lib = os.path.join(root, "include"), os.path.join(root, "lib")
    if (not os.path.exists(os.path.join(include, "tvm", "ffi", "c_api.h"))
            or not glob(os.path.join(lib, "libtvm_ffi.*"))):
        return None
    return include, lib


def extension(path: str) -> Extension | None:
    name = path[:-4].replace("/", ".")
    if name != "ext.grammar_step":
        return Extension(name, [path], include_dirs=[numpy.get_include()], **COMMON)
    paths = tvm_ffi_paths()
    if paths is None:
        return None
    include, lib = paths
    return Extension(name, [path], include_dirs=[include], library_dirs=[lib], libraries=["tvm_ffi"],
                     runtime_library_dirs=[lib], **COMMON)


extensions = [e for e in (extension(path) for path in sorted(glob("ext/*.pyx"))) if e is not None]
setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}))
