"""genfast.native: a kernel that cannot be built is reported, never raised."""

from pathlib import Path

from genfast import native


def test_a_missing_source_is_a_reason_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GENFAST_NATIVE_KERNELS", "1")
    reason = native.build("absent", tmp_path / "absent.cpp", [], [], "test kernel")
    assert reason is not None and reason.startswith("its source is missing")


def test_missing_cpu_flags_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("GENFAST_NATIVE_KERNELS", "1")
    source = Path(tmp_path / "k.cpp")
    source.write_text("")
    assert native.build("flags", source, [], ["no_such_cpu_flag"], "test kernel") == "this CPU lacks no_such_cpu_flag"
