"""compile/policy.py's settings for a fresh start's compiles, checked where they act: Triton's C builds."""
from __future__ import annotations

import os
import shutil

import pytest

from flexengine.compile import unoptimised_launcher_builds

# A C extension that says whether its compiler optimised it (gcc and clang define __OPTIMIZE__ from -O1 on); the
# comment varies the source, which Triton's build cache is keyed by.
PROBE = r"""
#include <Python.h>
/* %s */
static PyObject *optimised(PyObject *self, PyObject *args) {
#ifdef __OPTIMIZE__
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}
static PyMethodDef methods[] = {{"optimised", optimised, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "flexengine_build_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_flexengine_build_probe(void) { return PyModule_Create(&module); }
"""


def test_triton_builds_its_c_modules_unoptimised_once_asked(monkeypatch, tmp_path):
    """After unoptimised_launcher_builds (the model runner calls it where it compiles on CUDA), a C module that Triton
    builds, as it builds each kernel signature's launcher, is compiled without optimisation; one built before was
    optimised (Triton's own -O3). A second call wraps nothing more."""
    triton_build = pytest.importorskip("triton.runtime.build")
    if shutil.which(os.environ.get("CC") or "gcc") is None and shutil.which("clang") is None:
        pytest.skip("no C compiler: Triton builds nothing here")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_build, "_build", triton_build._build)  # (the original comes back after the test)

    def optimised(tag: str) -> bool:
        return triton_build.compile_module_from_src(PROBE % tag, "flexengine_build_probe").optimised()

    assert optimised("before") is True
    unoptimised_launcher_builds()
    wrapped = triton_build._build
    unoptimised_launcher_builds()
    assert triton_build._build is wrapped
    assert optimised("after") is False
