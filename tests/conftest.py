import os
import sys

# Tests import their helpers (multiproc, reference_demo) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
