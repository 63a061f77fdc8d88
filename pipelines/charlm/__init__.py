"""`charlm`: a small GPT-style character (byte) language model over the Python standard
library's own source files, which ship with every Python: no download.

    raytrain train charlm --workers 2 [--pipeline-arg corpus_mb=1 --pipeline-arg block=128
        --pipeline-arg layers=2 --pipeline-arg width=128 --pipeline-arg heads=4]

Rows are non-overlapping windows of block+1 bytes; the model predicts each next byte.
`val_bits_per_byte` and the corpus' unigram entropy (printed at start) tell how far
below the unigram baseline it has got.
"""

from pipelines.charlm.pipeline import CharLMPipeline

__all__ = ["CharLMPipeline"]
