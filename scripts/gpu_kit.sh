#!/usr/bin/env bash
# Gathers, on this Debian 12 x86-64 machine, what the lent GPU machine lacks
# into one ignored folder, .gpukit/ (or $ZCORE_GPU_KIT), for the device tool's
# `carry`:
#   debs/    Debian packages for the native build (apt-get download), kept as
#            .deb files: scripts/gpu_check.sh unpacks them with `dpkg -x` into
#            a scratch prefix and points CMake at it, never into /.
#   wheels/  cp312 manylinux x86-64 wheels (pip download --no-deps) of the
#            Python packages the package and the GPU tests need and the GPU
#            image lacks, or has at another version (its list: KINDS.md).
#   MANIFEST.txt  what is there: file, bytes, sha256.
# Pinned, one version of each; a file no longer pinned is removed. Idempotent:
# what is already there is not fetched again. The working tree plus the kit
# must stay under the device tool's 64 MiB; this script checks it.
set -euo pipefail
cd "$(dirname "$0")/.."

kit=${ZCORE_GPU_KIT:-.gpukit}
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3

# What the build's find_* calls need (cmake/aio.cmake: libaio.h and libaio.a;
# cmake/xxhash.cmake: xxhash.h; tests/cpp: GTestConfig.cmake; bench/cpp:
# benchmarkConfig.cmake) and the packages those depend on. The runtime
# libraries (libaio1, libxxhash0) come along: libaio-dev's libaio.so links to
# them, and libbenchmark.so is libbenchmark1debian's. googletest (libgtest-dev's
# dependency) is only GoogleTest's sources: not needed, as libgtest.a is built.
debs=(
  libaio1=0.3.113-4
  libaio-dev=0.3.113-4
  libxxhash0=0.8.1-1
  libxxhash-dev=0.8.1-1
  libgtest-dev=1.12.1-0.2
  libbenchmark1debian=1.7.1-1
  libbenchmark-dev=1.7.1-1
)

# pyproject.toml's dependencies and test extra against the GPU image:
#  - pydantic is missing there: pydantic, pydantic-core and their needs
#    (annotated-types, typing-inspection; typing-extensions>=4.16.0, which the
#    image has at a version not recorded, so it comes too).
#  - transformers is 5.17 there; the test extra pins 5.24.0 (zcore's Trainer
#    overrides transformers' own methods). Its needs are in the image at
#    versions that satisfy it (huggingface-hub 1.33, tokenizers 0.23.2,
#    safetensors 0.8.0; regex, typer, pyyaml, numpy, packaging, tqdm).
#  - torch, tqdm, xxhash (the Python package), pytest, pytest-timeout,
#    hypothesis, numpy, safetensors, accelerate 1.15.0, tensorboard,
#    matplotlib, scikit-build-core, pybind11, cmake, ninja are there.
#  - hjson is missing there (zcore reads DeepSpeed's config files with it).
#  - wandb is not, and is not carried: its wheel and its own needs (GitPython,
#    sentry-sdk, platformdirs...) are large, and only a monitor test uses it.
wheels=(
  hjson==3.1.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  transformers==5.24.0
)

mkdir -p "$kit/debs" "$kit/wheels"

# ---------------------------------------------------------------- debs --
wanted_debs=()
missing=()
for spec in "${debs[@]}"; do
  name=${spec%%=*} version=${spec#*=}
  file="${name}_${version//:/%3a}_amd64.deb"
  wanted_debs+=("$file")
  [ -s "$kit/debs/$file" ] || missing+=("$spec")
done
if ((${#missing[@]})); then
  echo "gpu_kit: apt-get download ${missing[*]}"
  if ! (cd "$kit/debs" && apt-get download -q "${missing[@]}"); then
    # The machine's package lists may be stale or absent: read fresh ones
    # into a private folder rather than touching the system's.
    lists=/tmp/zcore-gpukit-apt-lists
    mkdir -p "$lists/partial"
    echo "gpu_kit: apt-get download failed; fetching package lists into $lists"
    apt-get -q -o Dir::State::Lists="$lists" update
    (cd "$kit/debs" && apt-get download -q -o Dir::State::Lists="$lists" "${missing[@]}")
  fi
fi
for file in "$kit"/debs/*; do
  name=${file##*/}
  [[ " ${wanted_debs[*]} " == *" $name "* ]] || { echo "gpu_kit: removing $name (not pinned)"; rm -f "$file"; }
done

# -------------------------------------------------------------- wheels --
# The normalized project name at the start of a wheel's file name.
wheel_project() {
  local base=${1##*/}
  base=${base%%-*}
  base=${base,,}
  echo "${base//[._]/-}"
}
have_wheel() { # name version
  local f
  for f in "$kit"/wheels/*.whl; do
    [ -e "$f" ] || continue
    if [ "$(wheel_project "$f")" = "$1" ]; then
      local rest=${f##*/}
      rest=${rest#*-}
      [ "${rest%%-*}" = "$2" ] && return 0
    fi
  done
  return 1
}
pinned_projects=()
for spec in "${wheels[@]}"; do
  name=${spec%%==*} version=${spec#*==}
  pinned_projects+=("$name=$version")
  have_wheel "$name" "$version" && continue
  echo "gpu_kit: pip download $spec"
  "$python" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$kit/wheels" "$spec" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
  have_wheel "$name" "$version" || { echo "gpu_kit: no cp312 manylinux x86-64 wheel for $spec" >&2; exit 1; }
done
for f in "$kit"/wheels/*; do
  [ -e "$f" ] || continue
  base=${f##*/}
  rest=${base#*-}
  key="$(wheel_project "$f")=${rest%%-*}"
  [[ " ${pinned_projects[*]} " == *" $key "* ]] || { echo "gpu_kit: removing $base (not pinned)"; rm -f "$f"; }
done

# ------------------------------------------------------------ manifest --
{
  echo "# zcore GPU kit, gathered by scripts/gpu_kit.sh; file, bytes, sha256"
  (cd "$kit" && for f in debs/*.deb wheels/*.whl; do
    printf '%s %s %s\n' "$f" "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)"
  done)
} >"$kit/MANIFEST.txt"

echo "gpu_kit: gathered into $kit/"
(cd "$kit" && for f in debs/*.deb wheels/*.whl; do printf '  %-80s %9s bytes\n' "$f" "$(stat -c %s "$f")"; done)
kit_bytes=$(du -sb "$kit" | cut -f1)
# What the device tool sends: tracked and untracked-not-ignored files, plus the kit.
tree_bytes=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
limit=$((64 * 1024 * 1024))
total=$((kit_bytes + tree_bytes))
awk -v k="$kit_bytes" -v t="$tree_bytes" 'BEGIN {
  printf "gpu_kit: kit %.1f MiB; working tree %.1f MiB; together %.1f MiB of the 64 MiB a device call carries\n",
    k / 1048576, t / 1048576, (k + t) / 1048576 }'
((total < limit)) || { echo "gpu_kit: over the device tool's 64 MiB" >&2; exit 1; }
