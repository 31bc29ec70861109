"""The int8/int4 quantized linear (weight-only and dynamic int8): ops.py."""
