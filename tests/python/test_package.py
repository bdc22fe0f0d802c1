"""The installed package: imports on its own, reports its build, and keeps
torch out of the native library."""

import subprocess
import sys
from pathlib import Path

import zcore
from zcore import _C


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_before_torch_in_a_fresh_interpreter():
    out = run_python(
        "import sys; import zcore; print(zcore.cuda_available(), sys.modules['zcore._C'].__file__)"
    )
    assert out.split()[0] in ("True", "False")


def test_native_library_does_not_link_libtorch():
    needed = subprocess.run(
        ["readelf", "-d", _C.__file__], capture_output=True, text=True, check=True
    ).stdout
    assert "Shared library" in needed
    assert "torch" not in needed and "c10" not in needed


def test_native_library_exports_none_of_zcores_code():
    """zcore._C shares its process with torch: its own functions and the
    GNU unique objects of the headers it compiles (CCCL's, which bind
    process-wide even under RTLD_LOCAL) stay inside it. Exported, they made
    torch 2.11+cu130's own import crash when zcore._C was loaded first."""
    table = subprocess.run(
        ["readelf", "--dyn-syms", "-W", _C.__file__], capture_output=True, text=True, check=True
    ).stdout
    defined = [row.split() for row in table.splitlines() if len(row.split()) == 8 and row.split()[6] != "UND"]
    assert [r[7] for r in defined if r[4] == "UNIQUE"] == []
    functions = [r[7] for r in defined if r[3] == "FUNC" and r[4] in ("GLOBAL", "WEAK")]
    assert "PyInit__C" in functions
    assert [f for f in functions if "5zcore" in f] == []


def test_build_info_is_consistent():
    info = zcore.build_info()
    assert info["version"] == zcore.__version__
    assert info["io_backend"] in ("libaio", "threadpool")
    assert info["cuda_devices"] >= 0
    assert zcore.cuda_available() == (info["cuda_devices"] > 0)
    assert (zcore.cuda_unavailable_reason() == "") == zcore.cuda_available()
    if not info["cuda_built"]:
        assert "built without CUDA" in zcore.cuda_unavailable_reason()


def test_public_names_are_exported():
    for name in zcore.__all__:
        assert hasattr(zcore, name), name
    stub = Path(zcore.__file__).with_name("_C.pyi")
    assert stub.is_file(), "the _C stub ships with the package"
