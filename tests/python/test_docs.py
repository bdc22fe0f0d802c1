"""The documentation stays true to the code.

- docs/reference/config.md is what scripts/gen_config_reference.py makes of
  the config schema today, and the other spellings it says DeepSpeed reads
  are refused by zcore.
- docs/reference/api.md documents every name in ``zcore.__all__`` and the
  other public paths.
- The README's relative links (and their anchors) exist; mkdocs --strict
  checks the links of docs/ itself (scripts/docs.sh).
- The code blocks of README.md and docs/ marked ``<!-- run -->`` run: each in
  a fresh process, the blocks of one page in order in one scratch directory;
  a block marked ``<!-- run: write NAME -->`` is written to NAME there first.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

import zcore
from zcore.config import keys as config_keys
from zcore.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
GENERATOR = ROOT / "scripts" / "gen_config_reference.py"
BLOCK_TIMEOUT_S = 240

# What "the code blocks meant to run" must include, by page: (language, a
# string the block contains).
REQUIRED_EXAMPLES = {
    "README.md": [("python", 'config="ds_config.json"'), ("python", "optimizer=optimizer")],
    "docs/guide/training.md": [("python", 'config="ds_config.json"'), ("python", "optimizer=optimizer")],
    "docs/guide/checkpoints.md": [("python", "load_checkpoint"), ("bash", "zcore consolidate")],
    "docs/guide/planning.md": [("bash", "zcore estimate")],
}


@functools.cache
def _generator():
    """scripts/gen_config_reference.py, loaded as a module."""
    spec = importlib.util.spec_from_file_location("gen_config_reference", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# The configuration reference.


def test_config_reference_matches_the_schema():
    expected = _generator().render()
    current = (DOCS / "reference" / "config.md").read_text()
    assert current == expected, (
        "docs/reference/config.md disagrees with the config schema: run "
        ".venv/bin/python scripts/gen_config_reference.py and commit the result"
    )


@pytest.mark.parametrize("key, others", sorted(_generator().DEEPSPEED_SPELLINGS.items()))
def test_other_deepspeed_spellings_set_the_key_the_reference_says(key, others):
    def value_at(config):
        node = load_config(config)
        for part in key.split("."):
            node = getattr(node, part)
        return node

    default = value_at({"train_micro_batch_size_per_gpu": 1})
    given = {"enabled": True} if key == "bf16" else (not default) if isinstance(default, bool) else 7
    for other in others:
        *parents, leaf = other.split(".")
        config: dict = {"train_micro_batch_size_per_gpu": 1}
        section = config
        for part in parents:
            section = section.setdefault(part, {})
        section[leaf] = given
        got = value_at(config)
        assert (got.enabled if key == "bf16" else got) == (True if key == "bf16" else given), other


def test_every_deepspeed_key_that_is_not_zcores_own_is_listed():
    page = (DOCS / "reference" / "config.md").read_text()
    for key in [*config_keys.UNSUPPORTED_KEYS, *config_keys.TUNING_KEYS, *config_keys.ALIASES,
                *config_keys.OFFLOAD_SWITCHES]:
        assert f"| `{key}` |" in page, key


# The API reference.


def _documented_paths() -> list[str]:
    return re.findall(r"^::: (\S+)", (DOCS / "reference" / "api.md").read_text(), re.MULTILINE)


def test_api_reference_covers_the_public_names():
    paths = _documented_paths()
    missing = [name for name in zcore.__all__ if not any(p == f"zcore.{name}" or p.endswith(f".{name}") for p in paths)]
    assert not missing, f"docs/reference/api.md leaves out zcore.__all__ names: {missing}"
    for path in (
        "zcore.trainer.ZcoreTrainer",
        "zcore.pipelining.PipelineStage",
        "zcore.checkpoint",
        "zcore.optim",
        "zcore.config.Config",
    ):
        assert path in paths, path


def test_api_reference_paths_are_public():
    """Each documented path is importable as written (mkdocs reads the
    sources; this checks that users can reach the same objects)."""
    for path in _documented_paths():
        module, _, name = path.rpartition(".")
        try:
            target = importlib.import_module(path)
        except ModuleNotFoundError:
            target = getattr(importlib.import_module(module), name)
        assert target is not None, path


# Links.


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug, as mkdocs makes anchors."""
    text = re.sub(r"<[^>]+>|`", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(markdown: Path) -> set[str]:
    anchors = set()
    in_fence = False
    for line in markdown.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"#{1,6}\s+(.*?)\s*#*$", line)):
            anchors.add(_slug(m.group(1)))
    return anchors


def test_readme_links_resolve():
    text = README.read_text()
    links = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)
    assert links, "the README links nowhere: where does a reader go next?"
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # a URL
        target, _, anchor = link.partition("#")
        path = (ROOT / target) if target else README
        assert path.exists(), f"README.md links to {link}, which does not exist"
        if anchor:
            assert anchor in _anchors(path), f"README.md links to {link}: {target or 'README.md'} has no such heading"


def test_results_page_includes_bench_results():
    """The site shows bench/RESULTS.md itself, so the guides' links to it
    (results.md#...) find the figures' headings there."""
    assert '--8<-- "bench/RESULTS.md"' in (DOCS / "results.md").read_text()
    headings = _anchors(ROOT / "bench" / "RESULTS.md")
    for page in DOCS.rglob("*.md"):
        for anchor in re.findall(r"\(\.?\.?/?(?:\.\./)*results\.md#([^)]+)\)", page.read_text()):
            assert anchor in headings, f"{page.relative_to(ROOT)} links to results.md#{anchor}"


# The examples.


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    write_to: str | None  # a file to write instead of running


_MARKER = re.compile(r"^<!--\s*run(?::\s*write\s+(\S+))?\s*-->\s*$")


def marked_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    blocks = []
    for i, line in enumerate(lines):
        marker = _MARKER.match(line)
        if not marker:
            if re.match(r"^\s*<!--\s*run\b", line):
                raise ValueError(f"{page}:{i + 1}: a run marker this test does not know: {line!r}")
            continue
        fence = lines[i + 1] if i + 1 < len(lines) else ""
        opening = re.match(r"^```(\w+)\s*$", fence)
        if not opening:
            raise ValueError(f"{page}:{i + 1}: a run marker must stand on the line before a ``` fence")
        end = next((j for j in range(i + 2, len(lines)) if lines[j] == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{i + 2}: the marked block is never closed")
        language = opening.group(1)
        write_to = marker.group(1)
        if write_to is None and language not in ("python", "bash"):
            raise ValueError(f"{page}:{i + 2}: only python and bash blocks run (this one is {language})")
        blocks.append(Block(page, i + 2, language, "\n".join(lines[i + 2 : end]) + "\n", write_to))
    return blocks


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _pages_with_examples() -> list[str]:
    return [str(p.relative_to(ROOT)) for p in _pages() if any(b.write_to is None for b in marked_blocks(p))]


def test_required_examples_are_marked_to_run():
    for page, wanted in REQUIRED_EXAMPLES.items():
        blocks = [b for b in marked_blocks(ROOT / page) if b.write_to is None]
        for language, needle in wanted:
            assert any(b.language == language and needle in b.code for b in blocks), (
                f"{page} has no {language} example containing {needle!r} marked <!-- run -->"
            )


# The completion line a Python block prints last: with torch 2.13 and gloo a
# process that used a process group can abort in static teardown after the
# script is done (exit 134, "terminate called without an active exception";
# docs/guide/training.md, ending the script). Such an exit counts only after
# the whole block ran.
_DONE = "zcore-docs-test: block done"
_TEARDOWN_ABORT = "terminate called without an active exception"


def _run(block: Block, workdir: Path, index: int) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONWARNINGS"] = "error"  # the examples run as cleanly as the tests
    for launcher_var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(launcher_var, None)  # a world of one, as a reader running the example
    if block.language == "python":
        script = workdir / f"block_{index}.py"
        script.write_text(block.code + f"\nprint({_DONE!r}, flush=True)\n")
        command = [sys.executable, str(script)]
    else:
        script = workdir / f"block_{index}.sh"
        script.write_text("set -euo pipefail\n" + block.code)
        command = ["bash", str(script)]
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False
    )
    finished = done.returncode == 0 or (
        block.language == "python"
        and done.returncode in (134, -6)
        and _DONE in done.stdout
        and _TEARDOWN_ABORT in done.stderr
    )
    assert finished, (
        f"the example at {block.page}:{block.line} failed (exit {done.returncode}):\n"
        f"--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-5000:]}"
    )


@pytest.mark.parametrize("page", _pages_with_examples())
def test_examples_run(page, tmp_path):
    for index, block in enumerate(marked_blocks(ROOT / page)):
        if block.write_to is not None:
            (tmp_path / block.write_to).write_text(block.code)
        else:
            _run(block, tmp_path, index)
