"""SavedCompiled: compiled once, loaded by later runs, keyed on what the code depends on."""

import copy
import io

import pytest
import torch
from torch import nn

from genfast.compilation import artifacts
from genfast.compilation import saved as saved_compile
from genfast.compilation.saved import compile_notes, compile_saved
from genfast.interface.progress import Ticker
from genfast.kernels import native
from genfast.storage import cache


class Block(nn.Module):
    def __init__(self, width: int = 16, act: str = "gelu") -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.act = act  # a plain attribute forward reads: part of the key

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        y = self.proj(self.norm(x))
        return scale * (torch.nn.functional.gelu(y) if self.act == "gelu" else torch.relu(y)) + x


def _saved(module: nn.Module, messages: list[str], **depends_on) -> nn.Module:
    """`module` compiled as a new process would: nothing compiled in memory."""
    saved_compile._READY.clear()
    return compile_saved(module, "test block", depends_on, {}, log=messages.append)


def _keys() -> set[str]:
    return {entry["key"] for entry in artifacts.entries()}


@pytest.fixture()
def x() -> torch.Tensor:
    return torch.randn(2, 8, 16)


def test_compiled_once_then_loaded_with_equal_outputs(x):
    torch.manual_seed(0)
    block = Block().eval()
    expected = block(x)
    first = _saved(copy.deepcopy(block), [])
    fresh = first(x)
    assert first.forward.events[0].startswith("compiled in")
    assert len(_keys()) == 1
    messages = []
    again = _saved(copy.deepcopy(block), messages)
    cached = again(x)
    assert again.forward.events[0].startswith("loaded in") and "earlier run" in again.forward.events[0]
    assert any("loaded the compiled test block" in m for m in messages)
    torch.testing.assert_close(fresh, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached, expected, rtol=1e-5, atol=1e-5)
    assert compile_notes(nn.Sequential(again)) == [f"test block {again.forward.events[0]}"]
    (entry,) = artifacts.entries()
    assert cache._describe(entry).startswith("test block: inputs 2x8x16 float32; torch ")


def test_weights_are_inputs_not_constants(x):
    """Another module of the same structure (other weights) shares the artifact and gets its own answer."""
    torch.manual_seed(0)
    _saved(Block().eval(), [])(x)
    torch.manual_seed(1)
    other = Block().eval()
    saved = _saved(other, [])
    out = saved(x)
    assert saved.forward.events[0].startswith("loaded")
    torch.testing.assert_close(out, other(x), rtol=1e-5, atol=1e-5)


def test_the_key_follows_what_the_code_depends_on(x):
    _saved(Block().eval(), [])(x)
    _saved(Block().eval(), [])(x[:1])  # another input shape
    _saved(Block().eval(), [])(x, scale=2.0)  # another non-tensor argument
    _saved(Block().eval().to(torch.bfloat16), [])(x.to(torch.bfloat16))  # another dtype
    _saved(Block(width=16, act="relu").eval(), [])(x)  # another plain attribute
    _saved(Block(width=32).eval(), [])(torch.randn(2, 8, 32))  # another structure
    _saved(Block().eval(), [], quant="int8")(x)  # what the caller says it depends on
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):  # inductor's global settings
        _saved(Block().eval(), [])(x)
    assert len(_keys()) == 8


def test_a_corrupt_artifact_is_rebuilt_with_a_message(x):
    block = Block().eval()
    _saved(copy.deepcopy(block), [])(x)
    (entry,) = artifacts.entries()
    path = artifacts.Artifacts(entry["key"], {}).path("forward")
    path.write_bytes(b"not a compiled function")
    messages = []
    saved = _saved(block, messages)
    out = saved(x)
    assert any("could not be loaded" in m and "rebuilt" in m for m in messages)
    assert saved.forward.events[0].startswith("compiled in")
    torch.testing.assert_close(out, block(x), rtol=1e-5, atol=1e-5)
    assert path.stat().st_size > 100  # saved again


def test_the_kernels_to_load_first_grow_with_each_saved_step(monkeypatch):
    """A saved decode step calls the decode attention kernel that the prefill saved before it did
    not; a later run must load it before either step (it failed so when the list was written once)."""

    class Compiled:
        def save_compiled_function(self, path: str) -> None:
            with open(path, "wb") as f:
                f.write(b"compiled")

    store = artifacts.Artifacts("steps", {"what": "two steps"})
    monkeypatch.setattr(native, "_LOADED", {"qlinear": "avx2"})
    store.save("prefill", Compiled())
    assert store.saved_description()["kernels"] == ["qlinear"]
    monkeypatch.setattr(native, "_LOADED", {"qlinear": "avx2", "decode_attention": "avx2"})
    store.save("decode", Compiled())
    assert store.saved_description()["kernels"] == ["decode_attention", "qlinear"]
    assert store.saved_description()["what"] == "two steps"


def test_a_step_that_cannot_be_saved_serves_its_run_and_says_so(tmp_path, monkeypatch):
    """A read-only GENFAST_HOME or a full disk: saving fails, the compiled function is kept for the
    run (the callers return it), a half-written file is removed, and the log says why."""

    class Compiled:
        def save_compiled_function(self, path: str) -> None:
            with open(path, "wb") as f:
                f.write(b"half")
            raise OSError(28, "No space left on device")

    monkeypatch.setenv("GENFAST_HOME", str(tmp_path / "home"))
    store = artifacts.Artifacts("steps", {"what": "a step"})
    messages: list[str] = []
    store.try_save("decode", Compiled(), messages.append)
    why = "(No space left on device): the next run compiles it again"
    assert messages == [f"genfast: cannot save the compiled decode in {store.dir} {why}"]
    assert list(store.dir.iterdir()) == []  # no half-written artifact left
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GENFAST_HOME", str(blocker / "home"))
    unwritable = artifacts.Artifacts("steps", {"what": "a step"})
    unwritable.try_save("decode", Compiled(), messages.append)
    assert messages[-1].startswith(f"genfast: cannot save the compiled decode in {unwritable.dir}")


def test_a_compile_lock_whose_pid_another_process_now_has_is_stale(tmp_path, monkeypatch):
    """A worker killed (or a reboot) leaves compiling.lock; when its pid later belongs to another
    process, runs said "another genfast process is compiling" and stayed eager while that lived."""
    import os

    monkeypatch.setenv("GENFAST_HOME", str(tmp_path))
    store = artifacts.Artifacts("key", {"what": "a step"})
    assert store.try_lock() and store.compiling()  # held by this live process
    started = artifacts.start_ticks(os.getpid())
    # The same pid, now a process that started later: the lock's holder is gone.
    monkeypatch.setattr(artifacts, "start_ticks", lambda pid: str(int(started or 0) + 1))
    assert not store.compiling()
    assert store.try_lock()  # the stale lock is taken over
    monkeypatch.undo()
    store.unlock()
    (store.dir / "compiling.lock").write_text(str(os.getpid()))  # a lock from before start times
    assert store.compiling()


@torch._dynamo.allow_in_graph
class InGraphBlock(Block):
    """A class marked allow-in-graph, as diffusers marks its transformer blocks."""


def test_a_class_marked_allow_in_graph_compiles_and_loads(x):
    """Compiled code reaches the class's forward through the instance: dynamo cannot trace an
    attribute of an allow-in-graph class (`type(module).forward` failed on diffusers' blocks)."""
    torch.manual_seed(0)
    block = InGraphBlock().eval()
    expected = block(x)
    first = _saved(copy.deepcopy(block), [])
    torch.testing.assert_close(first(x), expected, rtol=1e-5, atol=1e-5)
    again = _saved(copy.deepcopy(block), [])
    torch.testing.assert_close(again(x), expected, rtol=1e-5, atol=1e-5)
    assert again.forward.events[0].startswith("loaded in")


def test_compiled_in_place_the_module_keeps_its_class_and_state_dict(x):
    block = Block().eval()
    names = list(block.state_dict())
    saved = _saved(block, [])
    assert saved is block and type(saved) is Block and list(saved.state_dict()) == names


def test_modules_of_one_structure_share_one_function_in_a_process(x):
    blocks = nn.Sequential(*(Block().eval() for _ in range(3)))
    expected = blocks(x)
    saved_compile._READY.clear()
    for block in blocks:
        compile_saved(block, "test block", {}, {}, log=lambda m: None)
    torch.testing.assert_close(blocks(x), expected, rtol=1e-5, atol=1e-5)
    assert [len(b.forward.events) for b in blocks] == [1, 0, 0]  # compiled once, reused twice


class TwoPartBlock(Block):
    """A module whose forward mixes a part compiled on its own with an eager one."""

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.inner(x, scale) * x.shape[1]  # eager: whatever the sequence's length

    def inner(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return super().forward(x, scale)


def test_a_method_other_than_forward_compiles_and_loads(x):
    """`method=`: one method is compiled (and saved, keyed apart from the forward's), the module's
    forward calling it stays eager."""
    torch.manual_seed(0)
    block = TwoPartBlock().eval()
    expected = block(x)

    def saved_inner() -> TwoPartBlock:
        saved_compile._READY.clear()
        return compile_saved(copy.deepcopy(block), "test block", {}, {}, log=lambda m: None, method="inner")

    first = saved_inner()
    assert "forward" not in vars(first) and isinstance(vars(first)["inner"], saved_compile.SavedForward)
    torch.testing.assert_close(first(x), expected, rtol=1e-5, atol=1e-5)
    assert first.inner.events[0].startswith("compiled in")
    assert compile_notes(first) == [f"test block {first.inner.events[0]}"]
    again = saved_inner()
    torch.testing.assert_close(again(x), expected, rtol=1e-5, atol=1e-5)
    assert again.inner.events[0].startswith("loaded in")
    whole = _saved(copy.deepcopy(block), [])
    torch.testing.assert_close(whole(x), expected, rtol=1e-5, atol=1e-5)
    assert whole.forward.events[0].startswith("compiled in")  # the forward's key is not the method's
    assert len(_keys()) == 2


def test_ticker_reports_a_wait_in_a_log():
    stream = io.StringIO()
    with Ticker("genfast: compiling X", stream=stream):
        pass
    lines = stream.getvalue().splitlines()
    assert lines[0] == "genfast: compiling X ..."
    assert lines[1].startswith("genfast: compiling X ... done in ")
