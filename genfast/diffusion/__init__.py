"""Text-to-image diffusion: diffusers pipelines loaded and made fast by diffusion-fast's recipe."""

# The recipe's steps in ladder order (genfast/diffusion/recipe.py); here so the CLI can list them
# without importing torch or diffusers.
DIFFUSION_STEPS = ("baseline", "bf16", "sdpa", "channels_last", "fused-qkv", "conv1x1-linear", "compile",
                   "dynamic-int8", "int8-conv", "group-norm-kernel",
                   "regional-compile", "dynamic-shapes", "feature-cache")
