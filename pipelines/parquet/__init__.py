"""`parquet`: bring-your-own tabular or vector data from a Parquet directory; an MLP.

    raytrain train parquet --pipeline-arg path=DIR --pipeline-arg label=COLUMN \\
        [--pipeline-arg features=a,b,c] [--pipeline-arg task=classification|regression] \\
        [--pipeline-arg val_path=DIR | --pipeline-arg val_fraction=0.1] [--pipeline-arg hidden=128]

Feature columns may be scalars or fixed-shape tensors (flattened); they are packed into
one float32 tensor column in Ray Data (`map_batches`), which is ~5× faster to batch than
many scalar columns.
"""

from pipelines.parquet.pipeline import ParquetPipeline

__all__ = ["ParquetPipeline"]
