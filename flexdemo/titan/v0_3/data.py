"""flexdemo's embedded corpus (flexdemo.data) as a torchtitan 0.3.0 dataloader component: the
trainer builds ``config.dataloader`` (0.2.2: TrainSpec.build_dataloader_fn), so the Config put
there names this class. The dataset is 0.2.2's StdlibTextDataset, read the same way (same
documents, same seed: ``[debug] seed``, as 0.2.2 seeds it). The tokenizer is torchtitan's
HuggingFaceTokenizer on flexdemo's asset dir (toml_config resolves an empty hf_assets_path).

Any other dataset (c4, ...) is torchtitan's, as on 0.2.2 (its build_text_dataloader):
:class:`TextDataLoader`, 0.3.0's HuggingFaceTextDataLoader without the per-document ``positions``
0.3.0 adds to each batch -- 0.2.2's text batches have none (RoPE counts from the window's start,
attention causal over the window), and flexdemo's model attends with causal SDPA on both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import torch.distributed as dist
import tyro
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.tools.logging import logger

from flexdemo.data.assets import corpus_sha256, ensure_assets, load_corpus, read_manifest
from flexdemo.data.dataset import SPLITS, StdlibTextDataset
from flexdemo.data.same_data import check_same_data_on_all_ranks
from flexdemo.section import FlexDemoConfigError

from ..data_position import ReshardingMixin, saved_world_size_to_reshard
from ..elastic import shard_among_replicas
from .legacy import legacy_view


class FlexDataLoader(ReshardingMixin, ParallelAwareDataloader):
    """flexdemo's corpus; a checkpointed position also loads where the data-parallel world size
    changed since the save (flexdemo.titan.data_position, as 0.2.2's ReshardingDataloader)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "flexdemo_stdlib"
        """One of flexdemo's embedded splits (flexdemo.data.dataset.SPLITS)."""
        dataset_path: str = ""
        """The corpus's asset dir ("": flexdemo's cache, built on first use)."""
        seed: int = 0
        """Shuffle seed of the documents (0.2.2: ``[debug] seed``)."""
        infinite: bool = True
        elastic: Annotated[tuple[int, int] | None, tyro.conf.Suppress] = None
        """(group_size, replica_id) of an elastic replica ([fault_tolerance]; set by FlexTrainer, not
        a setting): its ranks read their shard of every replica's data (flexdemo.titan.elastic)."""
        run: Annotated[Any, tyro.conf.Suppress] = None
        """The run's FlexRun (set by FlexTrainer; not a setting): the checkpoint it resumes, whose
        data position is resharded where the data-parallel world size changed."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = None, **_) -> None:
        if config.elastic is not None:
            dp_world_size, dp_rank = shard_among_replicas(dp_world_size, dp_rank, *config.elastic)
        name = config.dataset.lower()
        if name not in SPLITS:
            raise FlexDemoConfigError(f"dataset {config.dataset!r} is not one of flexdemo's ({sorted(SPLITS)}); "
                                      "on torchtitan 0.3.0 flexdemo's TOML reader takes these only")
        if config.num_workers > 1:  # every worker would replay the same stream
            raise FlexDemoConfigError(f"{name} supports dataloader num_workers 0 or 1")
        corpus, split = SPLITS[name]
        assets = ensure_assets(config.dataset_path or None, corpus=corpus)
        check_same_data_on_all_ranks(assets, tokenizer, name)  # (as 0.2.2's loader)
        documents = load_corpus(assets)[split]
        tokens = read_manifest(assets).get("estimated_tokens", {}).get(split)
        size = f", ~{tokens / 1e6:.1f} M tokens" if tokens else ""
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info(f"{name}: {len(documents)} documents{size} from {assets} "
                        f"(corpus_sha256={corpus_sha256(assets)}), dp world {dp_world_size}")
        dataset = StdlibTextDataset(documents, tokenizer, seq_len=seq_len, dp_rank=dp_rank,
                                    dp_world_size=dp_world_size, infinite=config.infinite,
                                    seed=config.seed, name=name)
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                         num_workers=config.num_workers, pin_memory=config.pin_memory)
        if config.run is not None:
            self.reshard_from(saved_world_size_to_reshard(legacy_view(config.run.config), dp_rank))


class TextDataLoader(HuggingFaceTextDataLoader):
    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        # (named apart from build()'s seq_len / local_batch_size kwargs, which 0.3.0 refuses to shadow)
        validation_seq_len: int = 0
        """The validator's sequence length when it differs from the training's (0: the training's)."""
        validation_local_batch_size: int = 0
        """The validator's local batch size when it differs from the training's (0: the training's)."""

    def __init__(self, config: Config, *, seq_len: int, local_batch_size: int, **kwargs) -> None:
        super().__init__(config, seq_len=config.validation_seq_len or seq_len,
                         local_batch_size=config.validation_local_batch_size or local_batch_size, **kwargs)

    def __iter__(self):
        for input_dict, labels in super().__iter__():
            input_dict.pop("positions", None)  # as 0.2.2's batches: positions 0..seq_len-1
            yield input_dict, labels
