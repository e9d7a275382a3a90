"""Build the Cython hot path into private modules ``kfeed._<name>``.

Compiler directives are set once here. ``KFEED_DEBUG=1`` turns bounds and
wrap-around checks on, for fuzzing builds; it also defines the C macro
``KFEED_DEBUG`` and writes the generated C under ``build/cython-debug``, so a
debug build never leaves bounds-checked C in ``ext/`` for the next optimized
build to reuse (cythonize regenerates a .c only when its .pyx is newer, not
when the directives change).
"""

import os
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("KFEED_DEBUG", "") not in ("", "0")

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}

extensions = [
    Extension(
        f"kfeed.{path.stem}",
        [str(path)],
        include_dirs=[np.get_include(), "ext"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
        + ([("KFEED_DEBUG", "1")] if DEBUG else []),
        extra_compile_args=["-O0", "-g"] if DEBUG else ["-O3"],
    )
    for path in sorted(Path("ext").glob("_*.pyx"))
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        build_dir="build/cython-debug" if DEBUG else None,
    )
)
