"""The MXFP4 expert linear (gpt-oss expert weights as 4-bit codes): ops.py."""
