"""torchtitan 0.2.2 plugin wiring for flexdemo.

Use from a TOML config:
    [job] custom_config_module = "flexdemo.titan.config"
    [experimental] custom_import = "flexdemo.titan.register"
    [model] name = "flexdemo_llama3"   # or "flexdemo_qwen3"
and launch with ``python -m flexdemo.titan.run`` (or ``scripts/launch.sh``).
"""
