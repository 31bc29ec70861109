"""FLOPs of SD 1.5's UNet (one classifier-free-guidance step: batch 2, 64x64 latents, 77 text
tokens) and VAE decode at 512x512, counted by torch.utils.flop_counter on the meta device.

    python benchmarks/diffusion_flops.py
"""

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from torch.utils.flop_counter import FlopCounterMode

from genfast.diffusion import pipelines


def tflop(fn) -> float:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() / 1e12


def main() -> None:
    with torch.device("meta"):
        unet = UNet2DConditionModel(**pipelines._SD15_UNET)
        vae = AutoencoderKL(**pipelines._VAE, sample_size=512)
        latents, text = torch.randn(2, 4, 64, 64), torch.randn(2, 77, 768)
        print(f"UNet, one CFG step (batch 2): {tflop(lambda: unet(latents, torch.tensor(10), text)):.2f} TFLOP")
        print(f"VAE decode, 512x512: {tflop(lambda: vae.decode(torch.randn(1, 4, 64, 64))):.2f} TFLOP")


if __name__ == "__main__":
    main()
