"""torch.compile settings and compiled code kept on disk for later runs."""
