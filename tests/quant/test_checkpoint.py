"""Quantized safetensors checkpoints: exact round trips and clear errors for bad files."""

import json

import pytest
import torch
from torch import nn

from genfast.errors import UserError
from genfast.quant.checkpoint import QuantizedCheckpoint, load_quantized_into, save_quantized
from genfast.quant.linear import QuantLinear, quantize_linears


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 72)
        self.up = nn.Linear(72, 40, bias=True)
        self.down = nn.Linear(40, 64, bias=False)
        self.norm = nn.LayerNorm(64)

    def forward(self, tokens):
        return self.norm(self.down(torch.relu(self.up(self.embed(tokens)))))


def quantized_net(bits: int, group_size: int | None) -> Net:
    torch.manual_seed(0)
    net = Net().eval()
    quantize_linears(net, bits, group_size)
    return net


@pytest.mark.parametrize("bits,group_size", [(8, None), (8, 32), (4, 32), (4, 64)])
def test_save_load_round_trip_is_exact(bits, group_size, tmp_path):
    net = quantized_net(bits, group_size)
    save_quantized(net, tmp_path / "q.safetensors", {"note": "test"})
    torch.manual_seed(1)
    fresh = Net().eval()
    checkpoint = QuantizedCheckpoint(tmp_path / "q.safetensors")
    assert checkpoint.metadata["note"] == "test"
    load_quantized_into(fresh, checkpoint)
    assert isinstance(fresh.up, QuantLinear) and isinstance(fresh.down, QuantLinear)
    tokens = torch.tensor([[1, 2, 3, 9]])
    with torch.no_grad():
        assert torch.equal(fresh(tokens), net(tokens))
    for name in ("up", "down"):
        a, b = getattr(net, name).quantized_weight(), getattr(fresh, name).quantized_weight()
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and torch.equal(a.mins, b.mins)


def test_int4_codes_are_stored_two_per_byte(tmp_path):
    from safetensors import safe_open

    save_quantized(quantized_net(4, 32), tmp_path / "q.safetensors")
    with safe_open(str(tmp_path / "q.safetensors"), "pt") as f:
        assert f.get_tensor("up.codes").shape == (40, 96 // 2)  # 72 columns padded to 96
        assert f.get_tensor("up.scales").dtype == torch.float16


def rewrite(path, tensors=None, metadata=None):
    """Copy a checkpoint with some tensors or header entries replaced (None deletes)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        data = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        header = dict(f.metadata())
    for key, value in (tensors or {}).items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    for key, value in (metadata or {}).items():
        if value is None:
            header.pop(key)
        else:
            header[key] = value
    save_file(data, str(path), metadata=header)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(metadata={"format": None}), "not a genfast quantized checkpoint"),
        (dict(metadata={"version": "99"}), "version '99' is not supported"),
        (dict(metadata={"layers": "{not json"}), "no valid 'layers'"),
        (
            dict(
                metadata={
                    "layers": json.dumps({"up": {"bits": 3, "group_size": 32, "in_features": 72, "out_features": 40}})
                }
            ),
            "invalid quantization entry",
        ),
        (
            dict(
                metadata={
                    "layers": json.dumps(
                        {"up": {"bits": 4, "group_size": 64, "in_features": 72, "out_features": 40, "bias": True}}
                    )
                }
            ),
            "header .* implies",
        ),
        (dict(tensors={"down.scales": None}), "down.scales is missing"),
        (dict(tensors={"up.codes": torch.zeros(40, 10, dtype=torch.uint8)}), "up.codes has shape"),
        (dict(tensors={"up.scales": torch.zeros(40, 3, dtype=torch.float32)}), "unexpected dtypes"),
        (dict(tensors={"norm.weight": torch.zeros(3)}), "norm.weight has shape"),
        (
            dict(
                metadata={
                    "layers": json.dumps({"nope": {"bits": 8, "group_size": 96, "in_features": 72, "out_features": 40}})
                }
            ),
            "no linear for",
        ),
    ],
)
def test_bad_checkpoints_give_clear_errors(change, message, tmp_path):
    path = tmp_path / "q.safetensors"
    save_quantized(quantized_net(4, 32), path)
    rewrite(path, **change)
    with pytest.raises(UserError, match=message):
        load_quantized_into(Net(), QuantizedCheckpoint(path))


def test_truncated_file_is_refused(tmp_path):
    path = tmp_path / "q.safetensors"
    save_quantized(quantized_net(8, None), path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UserError, match="cannot read"):
        QuantizedCheckpoint(path)
