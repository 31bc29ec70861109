"""The decoder: its configuration, the shared layers, the families and the mixture of experts."""
