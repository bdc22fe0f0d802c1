"""scripts/setup.sh on machines unlike CI's: root without sudo, a user with
sudo, a user with neither, Debian's own Python, old or missing tools.

CI's machine already has the system packages, so the install path is driven
here with stand-ins for apt-get, dpkg, sudo, id, cmake, the compiler and
Python. They record how they were called and keep a fake dpkg database, so
the script runs exactly as on a real machine, minus the downloads. PATH holds
only the stand-ins and the few real tools the script uses, so nothing of
this machine (a real sudo, say) leaks in."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ["ninja-build", "libaio-dev", "libxxhash-dev", "libgtest-dev", "libbenchmark-dev"]
REAL_TOOLS = ["bash", "env", "basename", "dirname", "grep", "sed", "sort", "head", "tail", "rm", "mkdir", "cp"]

RECORD = 'printf "%s" "$(basename "$0")" >>"$SANDBOX/calls"; printf " %q" "$@" >>"$SANDBOX/calls"; echo >>"$SANDBOX/calls"'

STAND_INS = {
    # Installs by adding to the fake dpkg database (and putting the package's
    # programs on PATH); refuses, as the real one does, unless run as root.
    "apt-get": f"""
{RECORD}
echo "apt-get $1 DEBIAN_FRONTEND=${{DEBIAN_FRONTEND:-}} uid=$(id -u)" >>"$SANDBOX/apt-env"
[ "$(id -u)" -eq 0 ] || {{ echo "E: Could not open lock file - are you root?" >&2; exit 100; }}
[ "$1" = update ] && exit 0
[ "$1" = install ] || exit 100
shift
for pkg in "$@"; do
  case "$pkg" in -*) continue ;; esac
  echo "$pkg" >>"$SANDBOX/dpkg-db"
  [ -d "$SANDBOX/provides/$pkg" ] && cp "$SANDBOX/provides/$pkg"/* "$SANDBOX/bin/"
done
exit 0
""",
    # dpkg -s PKG: a line "PKG" in the database is installed; "PKG STATUS" is
    # known to dpkg in that state.
    "dpkg": """
[ "$1" = -s ] || exit 2
line=$(grep -E "^$2( |$)" "$SANDBOX/dpkg-db" 2>/dev/null | tail -n1)
[ -n "$line" ] || { echo "dpkg-query: package '$2' is not installed" >&2; exit 1; }
status=${line#"$2"}
echo "Package: $2"
echo "Status: ${status:- install ok installed}" | sed 's/Status:  /Status: /'
""",
    "sudo": f"""
{RECORD}
[ -e "$SANDBOX/sudo-refuses" ] && {{ echo "$USER is not in the sudoers file." >&2; exit 1; }}
# Like sudo, leading NAME=VALUE words set the command's environment.
while [[ "$1" == *=* ]]; do export "$1"; shift; done
FAKE_UID=0 exec "$@"
""",
    "id": '[ "$1" = -u ] && echo "$FAKE_UID"',
    "cmake": 'echo "cmake version $FAKE_CMAKE_VERSION"',
    "c++": "exit 0",
    # The interpreter: answers setup.sh's one question from FAKE_PY_FACTS, and
    # makes a virtual environment unless it is Debian's Python without its venv package.
    "python3": f"""
{RECORD}
case "$1" in
  -c) echo "$FAKE_PY_FACTS" ;;
  -m)
    [ "$2" = venv ] || exit 2
    if [ -e "$SANDBOX/venv-needs-package" ] && ! grep -qx 'python3.11-venv' "$SANDBOX/dpkg-db"; then
      echo "ensurepip is not available" >&2; mkdir -p "$3"; exit 1
    fi
    mkdir -p "$3/bin" && cp "$SANDBOX/venv-python" "$3/bin/python" ;;
esac
""",
}
VENV_PYTHON = RECORD


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    calls: list[list[str]]
    apt_env: list[str]

    def of(self, program: str) -> list[list[str]]:
        return [call[1:] for call in self.calls if call[0] == program]


class Machine:
    """A sandbox holding a copy of setup.sh and the stand-ins."""

    def __init__(self, root: Path):
        self.root = root
        self.repo = root / "repo"
        (self.repo / "scripts").mkdir(parents=True)
        shutil.copy(ROOT / "scripts" / "setup.sh", self.repo / "scripts" / "setup.sh")
        (self.repo / "requirements-dev.txt").write_text("pytest\n")
        self.bin = root / "bin"
        self.bin.mkdir()
        for tool in REAL_TOOLS:
            (self.bin / tool).symlink_to(shutil.which(tool))
        for name, body in STAND_INS.items():
            self._script(self.bin / name, body)
        self._script(root / "venv-python", VENV_PYTHON)
        for package, program in (("cmake", "cmake"), ("g++", "c++")):
            (root / "provides" / package).mkdir(parents=True)
            shutil.copy(self.bin / program, root / "provides" / package / program)
        (root / "dpkg-db").write_text("")
        self.env = {
            "PATH": str(self.bin),
            "SANDBOX": str(root),
            "HOME": str(root),
            "USER": "someone",
            "FAKE_UID": "0",
            "FAKE_CMAKE_VERSION": "3.25.1",
            "FAKE_PY_FACTS": "3.11 1 /opt/python",
        }

    @staticmethod
    def _script(path: Path, body: str) -> None:
        path.write_text("#!/usr/bin/env bash\n" + body.lstrip("\n"))
        path.chmod(0o755)

    def has_installed(self, *packages: str) -> None:
        with open(self.root / "dpkg-db", "a") as db:
            db.writelines(f"{pkg}\n" for pkg in packages)

    def lacks(self, program: str) -> None:
        (self.bin / program).unlink()

    def run(self) -> Run:
        done = subprocess.run(
            [str(self.repo / "scripts" / "setup.sh")],
            env=self.env, capture_output=True, text=True, timeout=60, check=False,
        )
        calls_file = self.root / "calls"
        calls = [shlex.split(line) for line in calls_file.read_text().splitlines()] if calls_file.exists() else []
        apt_file = self.root / "apt-env"
        apt_env = apt_file.read_text().splitlines() if apt_file.exists() else []
        return Run(done.returncode, done.stdout, done.stderr, calls, apt_env)


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    return Machine(tmp_path)


def assert_built(run: Run) -> None:
    pip = run.of("python")
    assert ["-m", "pip", "install", "-q", "torch==2.13.0"] in pip
    assert ["-m", "pip", "install", "-q", "-r", "requirements-dev.txt"] in pip
    assert any("--no-build-isolation" in call and call[-1] == "." for call in pip), pip


def assert_not_built(run: Run) -> None:
    assert run.of("python") == []


def installs(run: Run) -> list[str]:
    """The packages named in apt-get install calls, in order."""
    return [a for call in run.of("apt-get") if call[0] == "install" for a in call[1:] if not a.startswith("-")]


def test_root_without_sudo_installs_the_missing_packages(machine):
    machine.has_installed("ninja-build")
    run = machine.run()
    assert run.returncode == 0, run.stderr
    assert [call[0] for call in run.of("apt-get")] == ["update", "install"]
    assert installs(run) == ["libaio-dev", "libxxhash-dev", "libgtest-dev", "libbenchmark-dev"]
    assert run.apt_env[-1] == "apt-get install DEBIAN_FRONTEND=noninteractive uid=0"
    assert all(line.endswith("uid=0") for line in run.apt_env)
    assert run.of("sudo") == []
    assert_built(run)


def test_ordinary_user_installs_through_sudo(machine):
    machine.env["FAKE_UID"] = "1000"
    run = machine.run()
    assert run.returncode == 0, run.stderr
    sudo = run.of("sudo")
    assert len(sudo) == 2 and all("apt-get" in call for call in sudo)
    assert sorted(installs(run)) == sorted(LIBRARIES)
    assert run.apt_env[-1] == "apt-get install DEBIAN_FRONTEND=noninteractive uid=0"
    assert all(line.endswith("uid=0") for line in run.apt_env)
    assert_built(run)


@pytest.mark.parametrize("uid", ["0", "1000"])
def test_nothing_missing_installs_nothing(machine, uid):
    machine.env["FAKE_UID"] = uid
    machine.has_installed(*LIBRARIES)
    run = machine.run()
    assert run.returncode == 0, run.stderr
    assert run.of("apt-get") == [] and run.of("sudo") == []
    assert "installing" not in run.stdout
    assert_built(run)


def test_without_root_or_sudo_names_the_packages_and_the_command(machine):
    machine.env["FAKE_UID"] = "1000"
    machine.lacks("sudo")
    machine.has_installed("ninja-build", "libxxhash-dev", "libgtest-dev")
    run = machine.run()
    assert run.returncode != 0
    assert "apt-get install -y libaio-dev libbenchmark-dev" in run.stderr
    assert "no sudo" in run.stderr
    assert run.of("apt-get") == []
    assert_not_built(run)


def test_sudo_refused_names_the_packages_and_the_command(machine):
    machine.env["FAKE_UID"] = "1000"
    (machine.root / "sudo-refuses").touch()
    run = machine.run()
    assert run.returncode != 0
    assert "apt-get install -y " + " ".join(LIBRARIES) in run.stderr
    assert run.of("apt-get") == []
    assert_not_built(run)


def test_a_failing_install_stops_before_the_build(machine):
    machine.env["FAKE_UID"] = "1000"
    machine.bin.joinpath("apt-get").write_text("#!/usr/bin/env bash\nexit 100\n")
    run = machine.run()
    assert run.returncode != 0
    assert "could not install" in run.stderr and "libaio-dev" in run.stderr
    assert_not_built(run)


def test_a_removed_package_with_its_configuration_left_is_missing(machine):
    machine.has_installed(
        "ninja-build", "libxxhash-dev", "libgtest-dev", "libbenchmark-dev", "libaio-dev deinstall ok config-files"
    )
    run = machine.run()
    assert run.returncode == 0, run.stderr
    assert installs(run) == ["libaio-dev"]


def test_missing_compiler_and_cmake_are_installed(machine):
    machine.has_installed(*LIBRARIES)
    machine.lacks("c++")
    machine.lacks("cmake")
    run = machine.run()
    assert run.returncode == 0, run.stderr
    assert installs(run) == ["g++", "cmake"]
    assert_built(run)


def test_debian_python_gets_its_venv_and_header_packages(machine):
    machine.has_installed(*LIBRARIES)
    machine.env["FAKE_PY_FACTS"] = "3.11 0 /usr"
    (machine.root / "venv-needs-package").touch()
    run = machine.run()
    assert run.returncode == 0, run.stderr
    assert installs(run) == ["python3.11-venv", "python3.11-dev"]
    assert (machine.repo / ".venv" / "bin" / "python").exists()
    assert_built(run)


def test_another_python_without_headers_is_named_not_patched(machine):
    machine.has_installed(*LIBRARIES)
    machine.env["FAKE_PY_FACTS"] = "3.11 0 /opt/python"
    run = machine.run()
    assert run.returncode != 0
    assert "Python.h" in run.stderr and "PYTHON" in run.stderr
    assert run.of("apt-get") == []
    assert_not_built(run)


@pytest.mark.parametrize(("facts", "cmake", "expected"), [
    ("3.8 1 /usr", "3.25.1", "zcore needs 3.9 or newer"),
    ("3.11 1 /usr", "3.22.1", "cmake 3.22.1 is too old"),
])
def test_tools_too_old_are_refused_before_the_build(machine, facts, cmake, expected):
    machine.has_installed(*LIBRARIES)
    machine.env["FAKE_PY_FACTS"] = facts
    machine.env["FAKE_CMAKE_VERSION"] = cmake
    run = machine.run()
    assert run.returncode != 0
    assert expected in run.stderr
    assert_not_built(run)


def test_no_apt_get_names_what_is_missing(machine):
    machine.lacks("apt-get")
    machine.lacks("cmake")
    run = machine.run()
    assert run.returncode != 0
    assert "no apt-get" in run.stderr and "cmake" in run.stderr
    assert_not_built(run)


def test_setup_script_is_executable():
    assert os.access(ROOT / "scripts" / "setup.sh", os.X_OK)
