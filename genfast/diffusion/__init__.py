"""Text-to-image diffusion: diffusers pipelines loaded and made fast by diffusion-fast's recipe."""
