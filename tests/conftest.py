import os

import pytest
import torch

# Keep the suite deterministic and within CI's two cores.
torch.manual_seed(0)
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _genfast_home(tmp_path_factory, monkeypatch):
    """Every test gets a private, empty model cache unless it sets GENFAST_HOME itself."""
    if "GENFAST_HOME" not in os.environ or not os.environ.get("GENFAST_TEST_KEEP_HOME"):
        monkeypatch.setenv("GENFAST_HOME", str(tmp_path_factory.mktemp("genfast_home")))
