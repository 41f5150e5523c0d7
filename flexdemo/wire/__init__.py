"""The replica exchange's wire: the chunked DCT, bit packing, and the payload format's constants
and byte formulas. A leaf: it imports torch and the standard library only, nothing of flexdemo."""
