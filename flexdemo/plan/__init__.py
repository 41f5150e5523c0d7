"""Which mode for my cluster? ``python -m flexdemo.plan CONFIG --nodes N --link-gbit B ...``
predicts, per mode, the bytes each rank receives per step, the seconds per step, tokens/s per
GPU and memory per GPU, and recommends one (flexdemo.plan.__main__).

- :mod:`.model`: bytes (the library's own payload formulas), the time model, memory (the
  start-up estimate);
- :mod:`.compute`: the compute step of a config on a named GPU;
- :mod:`.evidence`: every measured number the planner uses, with its source;
- :mod:`.choose`: the recommendation;
- :mod:`.readme`: the README's mode-choice table, generated.
"""
