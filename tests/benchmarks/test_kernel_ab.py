"""Tests of benchmarks/kernel_ab.py: versions' sources found, built and raced in one process."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.kernel_ab import PLANES, compare, sources_of
from pypto_serving.kernels import cpu

needs_c = pytest.mark.skipif(not cpu.available(), reason="the C kernels do not run here")


def test_a_revision_s_sources_are_git_s_and_files_it_lacks_are_empty(tmp_path: Path, monkeypatch) -> None:
    here = cpu.SOURCES[0].parent
    if shutil.which("git") is None or subprocess.run(["git", "rev-parse", "HEAD"], cwd=here,
                                                     capture_output=True).returncode:
        pytest.skip("not a git checkout")
    monkeypatch.setattr(cpu, "HEADERS", [*cpu.HEADERS, here / "not_in_any_revision.h"])
    sources, headers = sources_of("HEAD", tmp_path)
    assert [p.name for p in sources] == [p.name for p in cpu.SOURCES]
    committed = subprocess.run(["git", "show", "HEAD:pypto_serving/kernels/cpu/qdot.c"], cwd=here,
                               capture_output=True, check=True).stdout
    assert (tmp_path / "HEAD" / "qdot.c").read_bytes() == committed
    assert headers[-1].name == "not_in_any_revision.h" and headers[-1].read_bytes() == b""
    with pytest.raises(SystemExit, match="no-such-revision"):
        sources_of("no-such-revision", tmp_path)


@needs_c
def test_versions_race_on_the_same_inputs_and_a_changed_kernel_shows_other_bits(tmp_path: Path) -> None:
    """The working tree against a copy whose mixed rule widens fewer groups: int8 and int16 give
    the same bits, mixed does not, and every version has a rate and a ratio to the first."""
    changed = tmp_path / "changed"
    changed.mkdir()
    for path in [*cpu.SOURCES, *cpu.HEADERS]:
        shutil.copy(path, changed / path.name)
    qdot = changed / "qdot.c"
    text = qdot.read_text()
    assert "#define WIDE_ENERGY 1e-6f" in text
    qdot.write_text(text.replace("#define WIDE_ENERGY 1e-6f", "#define WIDE_ENERGY 1e-3f"))
    rows = compare([".", str(changed)], [(48, 96)], [5], rounds=2)
    assert [(r.workload, r.version) for r in rows] == [
        (f"48x96 rows 5 {kind}", version) for kind in PLANES for version in (".", str(changed))]
    assert all(r.gmacs > 0 and r.low <= r.gmacs <= r.high for r in rows)
    assert [r.ratio for r in rows if r.version == "."] == [1.0] * len(PLANES)
    assert {r.workload.split()[-1]: r.same_bits for r in rows if r.version != "."} == {
        "int8": True, "mixed": False, "int16": True}
