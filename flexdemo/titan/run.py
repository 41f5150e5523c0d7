"""``python -m flexdemo.titan.run --job.config_file X.toml [--section.key v ...]``: the config
checked, then torchtitan's trainer main with flexdemo's FlexTrainer (flexdemo.titan.entry.run)."""

from .entry import run

if __name__ == "__main__":
    run()
