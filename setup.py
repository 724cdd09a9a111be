"""Builds the Cython hot loops in ext/; everything else is declared in pyproject.toml."""
from glob import glob

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(path[:-4].replace("/", "."), [path], include_dirs=[numpy.get_include()],
              extra_compile_args=["-O3"], define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])
    for path in sorted(glob("ext/*.pyx"))
]
setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}))
