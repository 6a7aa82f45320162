"""The C kernels build wherever they can run (else CI fails rather than silently testing only the
portable path), a failed build is a logged warning with the compiler's error, and the ctypes
mirrors of stack.c's structs are checked against the C layout."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from pypto_serving.backends import cpu_stack
from pypto_serving.kernels import cpu


def _c_path_reason() -> str | None:
    """Why the C kernels do not apply on this machine, or None where they must build."""
    if not cpu.has_avx2():
        return "this CPU lacks AVX2/FMA/F16C: the portable kernels are the only path here"
    if cpu.find_compiler() is None:
        return "no C compiler ($CC, cc or gcc): the portable kernels are the only path here"
    return None


needs_c_path = pytest.mark.skipif(_c_path_reason() is not None, reason=_c_path_reason() or "")


@pytest.fixture
def fresh_library():
    """library() tried again in this test, and again (with the real sources) after it."""
    cpu.library.cache_clear()
    yield
    cpu.library.cache_clear()


@needs_c_path
def test_the_c_kernels_build_where_they_can_run(fresh_library) -> None:
    with capture_logs() as logs:
        lib = cpu.library()
    assert lib is not None, f"the C kernels did not build or load: {logs}"
    assert not [e for e in logs if e["log_level"] == "warning"]


@needs_c_path
def test_a_failed_build_is_a_warning_with_the_compilers_error(fresh_library, monkeypatch,
                                                              tmp_path: Path) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("int broken_kernel(void) { return pypto_undeclared_name; }\n")
    monkeypatch.setattr(cpu, "SOURCES", [broken])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with capture_logs() as logs:
        assert cpu.library() is None
        assert not cpu.available()  # one attempt per process: no second warning
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    assert "failed to compile" in warning["event"] and "portable kernels" in warning["event"]
    assert "pypto_undeclared_name" in warning["stderr"] and "error" in warning["stderr"]
    assert str(broken) in warning["command"]
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_the_warning_keeps_the_end_of_a_long_compiler_output() -> None:
    output = ("x" * cpu.STDERR_CHARS + "fatal error: the last one").encode()
    tail = cpu._tail(output)
    assert tail.endswith("fatal error: the last one") and len(tail) == cpu.STDERR_CHARS + 3
    assert cpu._tail(b"short\n") == "short" and cpu._tail(None) == ""


@needs_c_path
def test_the_ctypes_structs_match_stack_c() -> None:
    cpu_stack.check_layout(cpu.library())


class _NarrowBits(ctypes.Structure):  # as if stack.c's int64_t bits were an int32: same sizeof, padded
    _fields_ = [*cpu_stack._QLinear._fields_[:-1], ("bits", ctypes.c_int32)]


class _NoZero(ctypes.Structure):  # a field missing: the ones after it move
    _fields_ = [f for f in cpu_stack._QLinear._fields_ if f[0] != "zero"]


def _with(name: str, cls: type[ctypes.Structure]) -> list[tuple[str, type[ctypes.Structure]]]:
    return [(c_name, cls if c_name == name else mirror) for c_name, mirror in cpu_stack.MIRRORED]


@needs_c_path
def test_the_layout_check_names_the_struct_and_field_that_differ() -> None:
    lib = cpu.library()
    with pytest.raises(RuntimeError, match=r"QLinear\.bits: offset 48 size 8 in stack\.c, offset 48 size 4"):
        cpu_stack.check_layout(lib, _with("QLinear", _NarrowBits))
    with pytest.raises(RuntimeError, match=r"QLinear: sizeof is 56 in stack\.c, 48 in _NoZero; QLinear: 7"):
        cpu_stack.check_layout(lib, _with("QLinear", _NoZero))
    with pytest.raises(RuntimeError, match="stack.c describes 5 structs, cpu_stack.py mirrors 4"):
        cpu_stack.check_layout(lib, cpu_stack.MIRRORED[:-1])


@needs_c_path
def test_a_decoder_stack_is_not_built_on_mismatched_structs(monkeypatch) -> None:
    monkeypatch.setattr(cpu_stack, "MIRRORED", _with("QLinear", _NarrowBits))
    with pytest.raises(RuntimeError, match=r"QLinear\.bits"):
        cpu_stack.DecoderStack(None, [])  # the check comes first: the model is not reached


def test_the_layout_comparison_without_a_compiler() -> None:
    """The comparison itself, against layouts as stack.c would give them, where no C runs."""
    layouts = [cpu_stack._ctypes_layout(cls) for _, cls in cpu_stack.MIRRORED]
    assert cpu_stack._layout_mismatches(layouts, cpu_stack.MIRRORED) == []
    [problem] = cpu_stack._layout_mismatches(layouts, _with("QLinear", _NarrowBits))
    assert problem.startswith("QLinear.bits:")
    assert cpu_stack._layout_mismatches(layouts, _with("QLinear", _NoZero)) == [
        "QLinear: sizeof is 56 in stack.c, 48 in _NoZero", "QLinear: 7 fields in stack.c, 6 in _NoZero"]
