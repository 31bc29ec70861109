"""`genfast info`: the machine, the ISA and which kernel variant runs, as a user would read it."""

import os

import torch

from genfast import cli
from genfast.kernels import registry
from genfast.platform import hardware, hugepages, threads


def test_info_names_the_isa_and_every_kernel(capsys):
    assert cli.main(["info", "--no-bandwidth"]) == 0
    out = capsys.readouterr().out
    assert "ISA:" in out and hardware.describe_isa() in out
    for kernel in registry.KERNELS:
        line = next(line for line in out.splitlines() if line.startswith(kernel.what + ":"))
        isa = kernel.loaded_isa()
        assert (f"native {isa}" in line) if isa else ("PyTorch path" in line)
    assert "--dtype auto:" in out and "read bandwidth" not in out


def test_info_says_where_llm_weights_live(capsys, monkeypatch):
    def weights_line() -> str:
        assert cli.main(["info", "--no-bandwidth"]) == 0
        return next(x for x in capsys.readouterr().out.splitlines() if x.startswith("LLM weights on the CPU:"))

    monkeypatch.setenv(hugepages.ENV, "0")
    assert weights_line().endswith(" in 4 KB pages (GENFAST_HUGEPAGES=0)")
    monkeypatch.delenv(hugepages.ENV)
    line = weights_line()
    reason = hugepages.unavailable_reason()
    assert (f"({reason})" in line) if reason else (f"transparent huge pages: {hugepages.thp_mode()}" in line)


def test_info_without_native_kernels_says_quantization_is_slow(capsys, monkeypatch):
    monkeypatch.setenv(hardware.ISA_ENV, "none")
    assert cli.main(["info", "--no-bandwidth"]) == 0
    out = capsys.readouterr().out
    assert "ISA:" in out and "GENFAST_ISA=none" in out
    assert "decode is slower than unquantized" in out


def test_a_bad_isa_override_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setenv(hardware.ISA_ENV, "avx9000")
    assert cli.main(["info", "--no-bandwidth"]) == 2
    assert "GENFAST_ISA='avx9000' is not an ISA level" in capsys.readouterr().err


def test_info_says_how_many_cpus_other_work_keeps_busy(capsys, monkeypatch):
    monkeypatch.setattr(threads.OtherWork, "busy_cores", lambda self: 1.0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cli.main(["info", "--no-bandwidth"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("other work now:"))
    assert "1.0 CPUs busy with other processes" in line and "would compute on 1 thread " in line


def test_a_bandwidth_that_cannot_be_kept_is_still_measured(tmp_path, monkeypatch, capsys):
    from genfast.bench import machine

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GENFAST_HOME", str(blocker / "home"))
    monkeypatch.delenv("GENFAST_PEAK_BW_GBS", raising=False)
    monkeypatch.setattr(machine, "measure_read_bandwidth", lambda device: 12.5e9)
    assert machine.peak_read_bandwidth("cpu") == 12.5e9
    assert f"cannot keep the measured bandwidth in {blocker / 'home'}" in capsys.readouterr().err


def test_inductor_compiles_into_its_own_folder_where_genfast_home_cannot_be_written(tmp_path, monkeypatch, capsys):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from genfast.compilation.inductor import use_persistent_cache
    from genfast.platform import hardware

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GENFAST_HOME", str(blocker / "home"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")  # restored afterwards
    use_persistent_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(default_cache_dir(), hardware.code_target())
    assert "compiled code goes to" in capsys.readouterr().err
