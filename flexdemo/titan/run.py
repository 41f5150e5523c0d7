"""``python -m flexdemo.titan.run --job.config_file X.toml [--section.key v ...]``: the config
checked, then torchtitan's trainer main with flexdemo's FlexTrainer (flexdemo.titan.entry.run)."""

from flexdemo.titan.entry import run  # absolute: also run as a path (torchrun --run-path)

if __name__ == "__main__":
    run()
