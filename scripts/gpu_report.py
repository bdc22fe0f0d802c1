"""Helpers for scripts/gpu_check.sh (standard library only, plus `packaging`,
which pip carries when it is not installed).

    gpu_report.py wheels --kit .gpukit [--machine here|gpu-image]
        Checks the kit's wheel set: one version per project, and every need of
        every wheel (Requires-Dist, markers read for CPython 3.12 on Linux
        x86-64, extras left out) met by another kit wheel or by the machine.
        Also checks pyproject.toml's dependencies and test extra the same way.
        --machine here: the packages of the interpreter running this (on the
        GPU machine: its own, with versions). --machine gpu-image: the GPU
        image's package list as recorded in the device tool's KINDS.md (names,
        and versions where a session read them): what a rehearsal on another
        machine can check.

    gpu_report.py summary --steps steps.tsv --out DIR [--env env.txt]
                          [--bench NAME=FILE ...]
        Writes DIR/summary.json (each step's name, seconds, status and note;
        pass/fail/skip counts of each junit XML file in DIR; the environment)
        and DIR/bench.json (each benchmark's tables as rows, the objects of
        its "BENCH_JSON {...}" lines under "json", and its output),
        then prints a short table. Exits 1 if a step failed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pip vendors it
    from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent

# The GPU image's Python packages (KINDS.md, "Python packages already there",
# read 2026-11-17), with the versions a session's pip list showed (2026-11).
GPU_IMAGE_VERSIONS = {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "tokenizers": "0.23.2", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0",
    "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "torchvision": "0.26.0",
}
_GPU_IMAGE_LIST = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
GPU_IMAGE_NAMES = frozenset(_GPU_IMAGE_LIST.split())

# Markers read as on the GPU machine: CPython 3.12 on Linux x86-64.
GPU_MARKERS = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}


# ------------------------------------------------------------------ wheels --


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        meta = HeaderParser().parsestr(zf.read(name).decode())
    return canonicalize_name(meta["Name"]), meta["Version"], meta.get_all("Requires-Dist") or []


def machine_packages(which: str) -> dict[str, str | None]:
    if which == "gpu-image":
        packages: dict[str, str | None] = {name: None for name in GPU_IMAGE_NAMES}
        packages.update(GPU_IMAGE_VERSIONS)
        return packages
    from importlib import metadata

    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}


def check_requirement(text: str, kit: dict[str, str], machine: dict[str, str | None]) -> tuple[str, str]:
    """('ok' | 'unknown' | 'missing', how it is met) for one requirement."""
    req = Requirement(text)
    name = canonicalize_name(req.name)
    for source, found in (("kit", kit.get(name, "")), ("machine", machine.get(name, ""))):
        if found is None:  # on the machine, version not recorded
            return "unknown", f"{name}{req.specifier} on the machine, version not recorded"
        if found and req.specifier.contains(Version(found), prereleases=True):
            return "ok", f"{name} {found} ({source})"
    have = kit.get(name) or machine.get(name)
    return "missing", f"{name}{req.specifier}: " + (f"only {have} there" if have else "absent")


def wheels_command(args: argparse.Namespace) -> int:
    wheels = sorted(Path(args.kit, "wheels").glob("*.whl"))
    if not wheels:
        print(f"gpu_report: no wheels in {args.kit}/wheels (run scripts/gpu_kit.sh)")
        return 1
    kit: dict[str, str] = {}
    needs: list[tuple[str, str]] = []
    errors = 0
    for path in wheels:
        name, version, requires = wheel_metadata(path)
        if name in kit:
            print(f"  FAIL two versions of {name} in the kit: {kit[name]} and {version}")
            errors += 1
        kit[name] = version
        tags = path.stem.split("-")[-3:]
        if tags[0] not in ("py3", "cp312") or not (tags[2] == "any" or "x86_64" in tags[2]):
            print(f"  FAIL {path.name}: not for CPython 3.12 on x86-64")
            errors += 1
        needs += [(f"{name} {version}", r) for r in requires]
    machine = machine_packages(args.machine)
    print(f"gpu_report: {len(kit)} wheels; their needs and pyproject.toml's, against the kit and "
          f"{'this interpreter' if args.machine == 'here' else 'the GPU image list (KINDS.md)'}")
    for who, text in needs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({**GPU_MARKERS, "extra": ""}):
            continue
        status, how = check_requirement(text, kit, machine)
        print(f"  {status:7} {who} needs {text}: {how}")
        errors += status == "missing"
    import tomllib  # Python 3.11+: both machines

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for group, texts, required in (
        ("dependencies", project["dependencies"], True),
        ("test extra", project.get("optional-dependencies", {}).get("test", []), False),
    ):
        for text in texts:
            status, how = check_requirement(text, kit, machine)
            label = status if required or status != "missing" else "warn"
            print(f"  {label:7} zcore {group}: {text}: {how}")
            errors += required and status == "missing"
    print(f"gpu_report: wheel set {'complete' if not errors else f'INCOMPLETE ({errors} problems)'}")
    return 1 if errors else 0


# ----------------------------------------------------------------- summary --


def junit_counts(path: Path) -> dict[str, object]:
    import xml.etree.ElementTree as ET

    counts = {"tests": 0, "passed": 0, "failed": 0, "skipped": 0, "failures": []}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return {"error": f"unreadable: {exc}"}
    for case in root.iter("testcase"):
        counts["tests"] += 1
        name = ".".join(filter(None, (case.get("classname"), case.get("name"))))
        status = case.get("status", "")  # ctest's: run, fail, notrun, disabled
        if case.find("failure") is not None or case.find("error") is not None or status == "fail":
            counts["failed"] += 1
            if len(counts["failures"]) < 30:
                counts["failures"].append(name)
        elif case.find("skipped") is not None or status in ("notrun", "disabled"):
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def markdown_tables(text: str) -> list[dict[str, object]]:
    """The pipe tables in a benchmark's output, each with the line above it."""
    tables: list[dict[str, object]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|\s*:?-", lines[i + 1]):
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            title = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip("|").split("|")]
                rows.append(dict(zip(header, cells)))
                i += 1
            tables.append({"title": title, "rows": rows})
        else:
            i += 1
    return tables


def bench_json(text: str) -> list[object]:
    """The objects of a benchmark's ``BENCH_JSON {...}`` lines (bench/gpu_step.py,
    bench/gpu_copy.py), in order; a line that does not parse is kept as its text."""
    found: list[object] = []
    for line in text.splitlines():
        if line.startswith("BENCH_JSON "):
            try:
                found.append(json.loads(line[len("BENCH_JSON "):]))
            except ValueError:
                found.append({"unparsed": line[:2000]})
    return found


def summary_command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    steps = []
    for line in Path(args.steps).read_text().splitlines():
        name, seconds, status, note = (line.split("\t") + ["", "", "", ""])[:4]
        steps.append({"name": name, "seconds": float(seconds), "status": status, "note": note})
    env: dict[str, str] = {}
    if args.env and Path(args.env).exists():
        for line in Path(args.env).read_text().splitlines():
            key, _, value = line.partition("=")
            if key:
                env[key] = value
    junit = {p.name: junit_counts(p) for p in sorted(out.glob("*.xml"))}
    bench = {}
    for item in args.bench or []:
        name, _, file = item.partition("=")
        text = Path(file).read_text() if Path(file).exists() else ""
        bench[name] = {"tables": markdown_tables(text), "output": text[-20000:]}
        figures = bench_json(text)
        if figures:
            bench[name]["json"] = figures
    failed = [s["name"] for s in steps if s["status"] == "fail"]
    summary = {
        "mode": args.mode,
        "result": "fail" if failed else "pass",
        "failed_steps": failed,
        "total_seconds": round(sum(s["seconds"] for s in steps), 1),
        "steps": steps,
        "junit": junit,
        "environment": env,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if bench:
        (out / "bench.json").write_text(json.dumps(bench, indent=2) + "\n")

    print("\n| step | seconds | status | note |")
    print("| --- | ---: | --- | --- |")
    for s in steps:
        print(f"| {s['name']} | {s['seconds']:.1f} | {s['status']} | {s['note']} |")
    print(f"| total | {summary['total_seconds']:.1f} | {summary['result']} | {args.mode} |")
    if junit:
        print("\n| junit | tests | passed | failed | skipped |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, c in junit.items():
            if "error" in c:
                print(f"| {name} | {c['error']} | | | |")
            else:
                print(f"| {name} | {c['tests']} | {c['passed']} | {c['failed']} | {c['skipped']} |")
        for name, c in junit.items():
            for test in c.get("failures", []):
                print(f"  failed in {name}: {test}")
    print(f"\ngpu_check ({args.mode}): {summary['result'].upper()}"
          + (f", failed steps: {' '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheels")
    w.add_argument("--kit", required=True)
    w.add_argument("--machine", choices=["here", "gpu-image"], default="here")
    s = sub.add_parser("summary")
    s.add_argument("--steps", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--mode", default="gpu")
    s.add_argument("--env")
    s.add_argument("--bench", action="append")
    args = parser.parse_args()
    return wheels_command(args) if args.command == "wheels" else summary_command(args)


if __name__ == "__main__":
    sys.exit(main())
