"""Where a built zcore crashes on import: each probe in its own process.

Run by gpu_check.sh's build step when the built module does not import. Each
probe loads a little more (the bare extension, then torch, then the package),
so the first one that dies names the layer; faulthandler prints the Python
frame, and cuda-gdb (the GPU image has no gdb) the native one.

    python scripts/gpu_import_probe.py SITE
"""

import shutil
import subprocess
import sys
from pathlib import Path

_LOAD_EXTENSION = """
import importlib.machinery, importlib.util, sys
path = next(__import__('pathlib').Path(sys.argv[1], 'zcore').glob('_C.*.so'))
loader = importlib.machinery.ExtensionFileLoader('zcore._C', str(path))
spec = importlib.util.spec_from_file_location('zcore._C', str(path), loader=loader)
C = importlib.util.module_from_spec(spec)
loader.exec_module(C)
print('loaded', path.name, flush=True)
"""

_CALLS = """
for name in ('compiler', 'io_backend', 'cuda_built', 'cuda_device_count', 'cuda_unavailable_reason'):
    fn = getattr(C, name, None)
    if fn is not None:
        print(name, '->', fn(), flush=True)
"""

PROBES = {
    "extension alone": _LOAD_EXTENSION + _CALLS,
    "torch, then extension": "import torch; print('torch', torch.__version__, flush=True)\n"
    + _LOAD_EXTENSION
    + _CALLS,
    "extension, then torch": _LOAD_EXTENSION
    + "import torch; print('torch', torch.__version__, torch.cuda.device_count(), flush=True)\n"
    + _CALLS,
    "torch.cuda initialised, then extension": "import torch; torch.zeros(1, device='cuda'); print('cuda up', flush=True)\n"
    + _LOAD_EXTENSION
    + _CALLS,
    "package": "import sys; sys.path.insert(0, sys.argv[1]); import zcore; print(zcore.build_info(), flush=True)",
}


def _run(code: str, site: str) -> int:
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", code, site],
        capture_output=True,
        text=True,
        timeout=120,
    )
    sys.stdout.write(result.stdout + result.stderr)
    return result.returncode


def main() -> int:
    site = sys.argv[1]
    first_crash = None
    for name, code in PROBES.items():
        print(f"--- probe: {name}", flush=True)
        rc = _run(code, site)
        print(f"--- probe: {name}: exit {rc}", flush=True)
        if rc != 0 and first_crash is None:
            first_crash = code
    debugger = shutil.which("cuda-gdb") or ("/usr/local/cuda/bin/cuda-gdb" if Path("/usr/local/cuda/bin/cuda-gdb").exists() else None)
    if first_crash is not None and debugger:
        print(f"--- native backtrace of the first crashing probe ({debugger})", flush=True)
        subprocess.run(
            [debugger, "-batch", "-ex", "run", "-ex", "bt 40", "-ex", "info sharedlibrary",
             "--args", sys.executable, "-c", first_crash, site],
            timeout=120,
        )
    return 0 if first_crash is None else 1


if __name__ == "__main__":
    sys.exit(main())
