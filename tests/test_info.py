"""`genfast info`: the machine, the ISA and which kernel variant runs, as a user would read it."""

from genfast import cli, hardware, kernels


def test_info_names_the_isa_and_every_kernel(capsys):
    assert cli.main(["info", "--no-bandwidth"]) == 0
    out = capsys.readouterr().out
    assert "ISA:" in out and hardware.describe_isa() in out
    for kernel in kernels.KERNELS:
        line = next(line for line in out.splitlines() if line.startswith(kernel.what + ":"))
        isa = kernel.loaded_isa()
        assert (f"native {isa}" in line) if isa else ("PyTorch path" in line)
    assert "--dtype auto:" in out and "read bandwidth" not in out


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
