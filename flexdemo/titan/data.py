"""Tokenizer/dataloader builders: flexdemo's offline stdlib corpus (flexdemo.data).

``flexdemo.data.dataloader`` serves ``[training] dataset = "flexdemo_stdlib"`` and passes
any other dataset name to torchtitan's own text loader.  Imported lazily so that the
train specs can be registered without touching the data package.
"""


def build_flexdemo_tokenizer(job_config):
    from flexdemo.data.dataloader import build_tokenizer

    return build_tokenizer(job_config)


def build_flexdemo_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
    from flexdemo.data.dataloader import build_dataloader

    return build_dataloader(
        dp_world_size=dp_world_size, dp_rank=dp_rank, tokenizer=tokenizer,
        job_config=job_config, **kwargs,
    )
