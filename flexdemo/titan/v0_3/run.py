"""``python -m flexdemo.titan.v0_3.run --job.config_file X.toml [--section.key v ...]`` (what
flexdemo.titan.launch starts per rank on torchtitan 0.3.0), or ``--module M --config F [...]``
(0.3.0's own spelling, parsed by torchtitan). flexdemo.titan.v0_3.entry does the work."""

from flexdemo.titan.v0_3.entry import run  # absolute: also run as a path (torchrun --run-path)

if __name__ == "__main__":
    run()
