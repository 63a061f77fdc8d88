"""`hf-causal-lm` and `hf-classification`: Hugging Face models from a local directory
(`pip install 'raytrain[hf]'`); nothing is downloaded.

    raytrain train hf-causal-lm --pipeline-arg model=DIR --pipeline-arg train=PATH \\
        [--pipeline-arg val=PATH --pipeline-arg tokenizer=DIR --pipeline-arg text_column=text \\
         --pipeline-arg block_size=128]
    raytrain train hf-classification --pipeline-arg model=DIR --pipeline-arg train=PATH \\
        [--pipeline-arg label_column=label --pipeline-arg num_labels=N ...]

`model=DIR` holds a config.json, with weights (loaded) or without (built from the config).
Inputs are .txt, .jsonl or .parquet files, or a `datasets` save_to_disk directory. A
classifier's text is tokenized in Ray Data (`map_batches`); a causal LM's is read in order and
every 1,000 rows concatenated and cut into blocks of `block_size` (HF's `group_texts`), the
same blocks at any worker count. Weight decay is off for biases and norms.
"""

from pipelines.hf.causal_lm import HFCausalLMPipeline
from pipelines.hf.classification import HFClassificationPipeline

__all__ = ["HFCausalLMPipeline", "HFClassificationPipeline"]
