"""`genfast quantize`: write a quantized copy of a model (weights, config, tokenizer) to a directory.

The directory loads like any other model (`--model DIR`): its safetensors header names the scheme
of every layer (genfast/quant/checkpoint.py), so nothing is re-quantized or guessed at load time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from genfast import __version__
from genfast.errors import UserError
from genfast.hardware import DTYPES
from genfast.hub import publish_directory, resolve_model
from genfast.llm.checkpoint import QUANTIZED_FILE, checkpoint_format, read_model_args
from genfast.llm.session import HEAD, LoadedModel, describe_quantization, load, quantize_loaded
from genfast.quant import DEFAULT_INT4_GROUP_SIZE, INT4_GROUP_SIZES


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse to touch anything but an empty directory or, with --force, an earlier output."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UserError(f"{out} is not empty; pass --force to replace an earlier `genfast quantize` output")
        if not _is_quantize_output(out):
            raise UserError(f"refusing to replace {out}: it is not a `genfast quantize` output")
    if not out.parent.is_dir():
        raise UserError(f"directory {out.parent} does not exist")


def _is_quantize_output(directory: Path) -> bool:
    from genfast.quant.checkpoint import QuantizedCheckpoint

    if (directory / "config.json").exists() or not (directory / QUANTIZED_FILE).is_file():
        return False
    try:
        QuantizedCheckpoint(directory / QUANTIZED_FILE)
    except UserError:
        return False
    return True


def gptq_quantize_model(loaded: LoadedModel, group_size: int, calibration: Path | None, n_windows: int,
                        window: int) -> str:
    """Replace the model's linears by GPTQ int4 layers; returns a description of the calibration."""
    from genfast.llm.calibration import calibrate_gptq, calibration_windows
    from genfast.llm.corpus import calibration_text

    if calibration is not None:
        if not calibration.is_file():
            raise UserError(f"calibration file not found: {calibration}")
        try:
            text, source = calibration.read_text(), str(calibration)
        except UnicodeDecodeError as e:
            raise UserError(f"calibration file {calibration} is not UTF-8 text") from e
    else:
        text, source = calibration_text(), "pydoc_data.topics (calibration half)"
    window = min(window, loaded.model.args.max_seq_len)
    try:
        windows = calibration_windows(loaded.tokenizer, text, n_windows, window)
    except ValueError as e:
        raise UserError(f"calibration text too short: {e}") from e
    start = time.perf_counter()
    # The head is not GPTQ'd: int4 models keep it in int8 (session.INT4_HEAD_BITS).
    weights = calibrate_gptq(loaded.model, windows, bits=4, group_size=group_size, progress=_log,
                             skip=lambda name, _: name == HEAD)
    _log(f"genfast: GPTQ done in {time.perf_counter() - start:.0f} s")
    quantize_loaded(loaded.path, loaded.model, 4, group_size, precomputed=weights)
    return f"{source}: {windows.shape[0]} windows x {windows.shape[1]} tokens"


def quantize_command(args: argparse.Namespace) -> int:
    out = Path(args.output)
    check_output_dir(out, args.force)
    if args.dtype not in DTYPES:
        raise UserError(f"unknown --dtype {args.dtype!r}; use bfloat16 or float32")
    bits = 8 if args.mode == "int8" else 4
    group_size = args.group_size
    if bits == 4:
        group_size = group_size or DEFAULT_INT4_GROUP_SIZE
        if group_size not in INT4_GROUP_SIZES:
            raise UserError(f"--group-size for int4 must be one of {', '.join(map(str, INT4_GROUP_SIZES))}")
    elif group_size is not None and group_size % 32:
        raise UserError("--group-size for int8 must be a multiple of 32")
    if args.calibration is not None and args.mode != "int4-gptq":
        raise UserError("--calibration only applies to --mode int4-gptq")
    path = resolve_model(args.model)
    if checkpoint_format(path) == "genfast":
        raise UserError(f"{path} is already quantized; quantize the original model instead")
    _log(f"genfast: quantizing {path} ({read_model_args(path).n_params / 1e6:.0f}M parameters) to {args.mode}")
    # Quantization arithmetic runs in fp32; unquantized tensors are stored in --dtype.
    calibration = None
    if args.mode == "int4-gptq":  # calibrates on the whole float model
        loaded = load(str(path), "cpu", "float32", args.threads)
        calibration = gptq_quantize_model(loaded, group_size, args.calibration, args.calibration_windows,
                                          args.calibration_window)
    else:  # round-to-nearest, block by block as the model is read: the float model never exists whole
        loaded = load(str(path), "cpu", "float32", args.threads, quant=args.mode, group_size=group_size)
    scheme = describe_quantization(loaded.model)
    metadata = {"model_args": json.dumps(loaded.model.args.to_dict()), "mode": args.mode, "scheme": scheme,
                "source": str(loaded.path), "genfast_version": __version__}
    if calibration:
        metadata["calibration"] = calibration
    from genfast.quant.checkpoint import save_quantized

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would make the published directory private
    try:
        save_quantized(loaded.model, staging / QUANTIZED_FILE, metadata, float_dtype=DTYPES[args.dtype])
        loaded.tokenizer.save(staging)
    except BaseException:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_directory(staging, out)
    size = (out / QUANTIZED_FILE).stat().st_size
    print(f"wrote {out} ({scheme}, {size / 1e6:.1f} MB); use it with --model {out}")
    return 0
