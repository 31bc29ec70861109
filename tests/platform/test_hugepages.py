"""genfast.platform.hugepages: weights moved into one huge-page mapping keep their values, identity and ties."""

import gc
import weakref

import pytest
import torch
from torch import nn

from genfast.llm.loading import load
from genfast.platform import hugepages
from tests.llm.gguf_fixtures import write_gguf_from_hf
from tests.llm.hf_fixtures import make_hf_model

needs_thp = pytest.mark.skipif(
    hugepages.unavailable_reason() is not None, reason=f"no huge pages here: {hugepages.unavailable_reason()}"
)


def weights() -> nn.Module:
    """Linears in bf16, an embedding tied to a head, a persistent uint8 buffer (packed codes), a
    non-persistent one (a cache) and a small norm."""
    embedding = nn.Embedding(512, 256).bfloat16()
    head = nn.Linear(256, 512, bias=False).bfloat16()
    head.weight = embedding.weight
    model = nn.ModuleDict(
        {"embedding": embedding, "up": nn.Linear(256, 1024).bfloat16(), "head": head, "norm": nn.LayerNorm(256)}
    )
    model.register_buffer("codes", torch.randint(0, 255, (384, 512), dtype=torch.uint8))
    model.register_buffer("cache", torch.zeros(256, 256), persistent=False)
    return model


@needs_thp
def test_moves_large_tensors_into_one_advised_mapping_and_keeps_values_identity_and_ties():
    model = weights()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    params = {name: p for name, p in model.named_parameters()}
    cache_address = model.cache.data_ptr()

    moved = hugepages.move_to_hugepages(model)

    large = [model.embedding.weight, model.up.weight, model.codes]  # the tied head is the embedding
    assert moved == sum(t.nbytes for t in large)  # 64-byte multiples already: no padding
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
    assert all(model.get_parameter(name) is p for name, p in params.items())  # same Parameter objects
    assert model.head.weight.data_ptr() == model.embedding.weight.data_ptr()  # still tied
    addresses = sorted(t.data_ptr() for t in large)
    assert addresses[-1] - addresses[0] < moved  # one mapping, in order
    assert all(a % hugepages.ALIGNMENT == 0 for a in addresses)
    assert len({t.untyped_storage().data_ptr() for t in large}) == 3  # a storage each: no aliasing inputs
    assert model.cache.data_ptr() == cache_address  # not a weight: left alone
    small = model.up.bias
    assert small.nbytes < hugepages.MIN_BYTES and small.data_ptr() not in range(addresses[0], addresses[-1])
    total, advised, granted = hugepages.placement(model)
    # Small tensors may sit in advised memory too, all of them at times: in the full suite some did
    # (memory that other code, numpy for one, advised and the allocator later reused).
    assert moved <= advised <= total and 0 <= granted <= advised
    # The module still computes the same thing.
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(model.up(x), nn.functional.linear(x, before["up.weight"], before["up.bias"]))


@needs_thp
def test_the_old_memory_is_released_as_tensors_move():
    model = weights()
    old_codes = weakref.ref(model.codes)
    hugepages.move_to_hugepages(model)
    gc.collect()
    assert old_codes() is None


def test_turned_off_by_the_variable_or_by_the_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv(hugepages.ENV, "0")
    model = weights()
    address = model.up.weight.data_ptr()
    assert hugepages.unavailable_reason() == f"{hugepages.ENV}=0"
    assert hugepages.move_to_hugepages(model) == 0 and model.up.weight.data_ptr() == address
    assert hugepages.empty((4, 4), torch.float32).shape == (4, 4)

    monkeypatch.delenv(hugepages.ENV)
    mode = tmp_path / "enabled"
    monkeypatch.setattr(hugepages, "THP_MODE_FILE", mode)
    mode.write_text("always madvise [never]\n")
    assert hugepages.thp_mode() == "never"
    assert "never" in hugepages.unavailable_reason()
    mode.write_text("always [madvise] never\n")
    assert hugepages.thp_mode() == "madvise"
    mode.unlink()
    assert hugepages.thp_mode() is None and "without transparent huge pages" in hugepages.unavailable_reason()


@needs_thp
def test_a_loaded_llm_has_its_weights_in_huge_pages_and_the_same_logits(tmp_path, monkeypatch):
    path = str(write_gguf_from_hf(make_hf_model("smollm"), tmp_path / "m.gguf", arch="llama"))
    placed = load(path, "cpu", "float32").model
    monkeypatch.setenv(hugepages.ENV, "0")
    plain = load(path, "cpu", "float32").model

    def large(model: nn.Module) -> int:  # what move_to_hugepages takes: one count per storage
        storages = {t.untyped_storage().data_ptr(): t.nbytes for t in model.parameters()}
        return sum(n for n in storages.values() if n >= hugepages.MIN_BYTES)

    assert hugepages.placement(placed)[1] >= large(placed) > 0
    assert hugepages.placement(plain)[1] < large(plain)  # not moved (see the first test on small ones)
    tokens = torch.randint(0, 100, (1, 9))
    for model in (placed, plain):
        model.setup_caches(1, 16)
    with torch.no_grad():
        out = [m(tokens, torch.arange(9), all_logits=True) for m in (placed, plain)]
    assert torch.equal(out[0], out[1])
