"""The machine genfast runs on: its device and instruction set, threads, huge pages."""
