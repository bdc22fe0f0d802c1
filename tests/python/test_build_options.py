"""The build's options: CUDA optional, libaio required unless the fallback
is chosen, with errors that say what to install."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")


def configure(build_dir: Path, *defines: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build_dir), "-DZCORE_BUILD_PYTHON=OFF", *defines],
        capture_output=True, text=True, timeout=300, check=False,
    )


def test_missing_libaio_names_the_package_and_the_fallback(tmp_path):
    # Hide the directories libaio is installed in from CMake's find_* calls.
    hidden = "/usr/include;/usr/lib/x86_64-linux-gnu;/usr/lib;/usr/local/include;/usr/local/lib"
    done = configure(tmp_path, "-DZCORE_CUDA=OFF", f"-DCMAKE_IGNORE_PATH={hidden}")
    assert done.returncode != 0
    assert "libaio-dev" in done.stderr and "ZCORE_AIO=THREADPOOL" in done.stderr


def test_cuda_on_without_nvcc_is_a_clear_error(tmp_path):
    done = configure(tmp_path, "-DZCORE_CUDA=ON", "-DCMAKE_CUDA_COMPILER=/nonexistent/nvcc")
    assert done.returncode != 0
    assert "nvcc" in done.stderr


def test_builds_without_cuda_and_without_libaio(tmp_path):
    """The core library and the CUDA-absent twin build with neither nvcc nor libaio."""
    done = configure(
        tmp_path, "-DZCORE_CUDA=OFF", "-DZCORE_AIO=THREADPOOL", "-DCMAKE_BUILD_TYPE=Debug"
    )
    assert done.returncode == 0, done.stderr
    assert "building without CUDA" in done.stdout
    built = subprocess.run(
        ["cmake", "--build", str(tmp_path), "--target", "zcore_cuda", "-j", "2"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]


def test_unknown_sanitizer_is_a_clear_error(tmp_path):
    done = configure(tmp_path, "-DZCORE_CUDA=OFF", "-DZCORE_SANITIZE=thread")
    assert done.returncode != 0
    assert "ZCORE_SANITIZE must be empty, address, undefined or address,undefined" in done.stderr
