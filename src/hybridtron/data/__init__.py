"""Pretraining data: corpus -> buckets -> mixture -> tokenizer -> packer -> resumable loader.

- `stdlib.py`: the embedded default corpus (this Python's standard library), 40 topics x 5 quality levels.
- `corpus.py`: `Document` and the readers of user data (JSONL, Parquet, text directories, rollouts).
- `tokenizer.py`: byte-level BPE trained on the corpus and cached; fixed special-token ids.
- `mixture.py`: presets and TOML weights, proportional proxy sub-sampling, repetition guard, report.
- `packing.py`: token caches and packing into rows with document-boundary-masked labels.
- `loader.py`: the weighted, resumable training loader and the fixed validation batches.
- `build.py`: `build_data(DataConfig) -> DataBundle`, the one entry point a training loop calls.
"""

from hybridtron.data.build import DataBundle, DataConfig, build_data, default_cache_dir, load_documents
from hybridtron.data.corpus import Document
from hybridtron.data.loader import PackedLoader
from hybridtron.data.mixture import MixtureReport
from hybridtron.data.tokenizer import SPECIAL_TOKENS, Tokenizer

__all__ = ["DataBundle", "DataConfig", "Document", "MixtureReport", "PackedLoader", "SPECIAL_TOKENS", "Tokenizer",
           "build_data", "default_cache_dir", "load_documents"]
